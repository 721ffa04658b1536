"""Internal. Stand-in trainers and engines, model layouts and a span recorder, for tests, the benchmark
and the examples."""
