"""Host tools: calibrate, simulate, report, routing traces, provenance."""
