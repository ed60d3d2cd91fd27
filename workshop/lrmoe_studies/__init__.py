"""megatron-lrmoe's studies: the drivers' machinery behind benchmarks/studies/ and the
stored results under benchmarks/results/ (time to loss, fitting to a device, projections,
the simulator's validations, the retention-bias and EP-regime studies, the layer
benchmarks). Development only: installed editable into the repository's .venv by
scripts/setup.sh, never shipped with megatron_lrmoe."""
