"""``weightsync doctor`` (being written)."""


def add_doctor_arguments(parser):
    pass


def run_doctor(args):
    raise SystemExit("weightsync doctor: not implemented yet")
