"""megatron-lrmoe's test harness: gloo process pools, the fake-CUDA harness, device-op
checks, host-read guards, the Bridge and Hub stand-ins the tests train with.
Development only (tests/ and scripts/dev/ use it), never shipped with megatron_lrmoe."""
