"""Host tools: calibrate, simulate, report, routing traces, provenance, and what the
benchmarks and studies share (layer_bench, time_to_loss, retention_bias, ...)."""
