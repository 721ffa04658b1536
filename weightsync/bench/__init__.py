"""``weightsync bench`` (being written)."""


def add_bench_arguments(parser):
    pass


def run_bench(args):
    raise SystemExit("weightsync bench: not implemented yet")
