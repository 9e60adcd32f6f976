"""Errors raised to users. Every one is raised before a collective is issued
and before any parameter, buffer or optimizer state is touched."""


class TranspileError(Exception):
    """The step cannot be transpiled as written; the message says what to do."""


class PassError(TranspileError):
    """A pass failed or its requirements were not met."""


class DivergenceError(TranspileError):
    """The ranks' parameters are no longer the same (check_consistency)."""


class VerificationError(TranspileError):
    """verify=N found the program computing something the eager step does not."""


class NoBackward(TranspileError):
    """The step, as traced on this call, calls no backward()."""
