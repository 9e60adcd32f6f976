"""Rank agreement: before the first collective of a new program, every rank
shows the others what it built (or the error it hit); any failure or mismatch
is raised on every rank instead of leaving some of them waiting forever. The
exchanges run on the control plane's gloo group (control_plane.py)."""

from __future__ import annotations

import hashlib

from .control_plane import all_gather_values
from ..errors import TranspileError
from ..program.program import InputKind, Program
from ..program.roles import COMM


def collective_summary(program: Program) -> list[str]:
    """The program's collectives in order (op, group, ring, dtype, numel, the
    parameters whose values they carry, in their order in the buffer), then
    the shapes of its parameters and buffers: what must be equal on every rank. Not
    the batch's shapes: as under DDP, ranks may hold batches of different sizes
    (a short last batch), and whatever a batch's shape changes in the
    collectives shows in them."""
    lines = []
    for node in program.collectives():
        val = node.meta["val"]
        comm = node.meta[COMM]
        carried = f" params={','.join(comm.params)}" if comm.params else ""
        lines.append(f"{program.name}: {comm.op} over={comm.over} ring={comm.ring} "
                     f"{val.dtype} numel={val.numel()}{carried}")
    for node in program.placeholders:
        spec = node.meta["input"]
        if spec.kind in (InputKind.PARAM, InputKind.BUFFER):
            lines.append(f"{program.name}: {spec.kind.value} {spec.name} "
                         f"{tuple(node.meta['val'].shape)}")
    return lines


def summarize(programs: list[Program]) -> tuple[str, list[str]]:
    """The digest of the programs' collective summaries, and the summary."""
    summary = [line for p in programs for line in collective_summary(p)]
    return hashlib.sha256("\n".join(summary).encode()).hexdigest(), summary


def outcome(programs: list[Program], error: BaseException | None) -> tuple:
    """What a rank shows the others of its build: ("ok", digest, summary) or
    ("error", message, None)."""
    if error is not None:
        return "error", f"{type(error).__name__}: {error}", None
    return ("ok", *summarize(programs))


def agree(programs: list[Program], error: BaseException | None) -> None:
    """Exchange each rank's programs (or its error) and raise the same error on
    every rank if one failed or if they differ."""
    mine = outcome(programs, error)
    compare(all_gather_values(mine), error)


def compare(everyone: list[tuple], error: BaseException | None) -> None:
    """everyone[r]: rank r's outcome(). Raise this rank's own error, or name
    the first rank that failed or built programs unlike rank 0's."""
    raise_first_failure([msg if status == "error" else None for status, msg, _ in everyone],
                        error, "build the step")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs[1] != reference[1]:
            raise TranspileError(
                f"rank {rank} built a different program than rank 0 "
                f"({first_difference(reference[2], theirs[2])}); every rank must run the "
                "same model (the same parameters requiring grad), mode and options; where a "
                "parameter gets a gradient on some ranks only (an expert no token of a rank's "
                "batch is routed to), pass transpile(..., find_unused_parameters=True), as DDP "
                "needs")


def raise_first_failure(messages: list[str | None], error: BaseException | None,
                        doing: str) -> None:
    """messages[r]: what failed on rank r, or None. Raise this rank's own error,
    or name the first rank that failed."""
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    if not failed:
        return
    if error is not None:
        raise error
    rank, msg = failed[0]
    raise TranspileError(f"rank {rank} could not {doing}, so no rank runs it: {msg}")


def agree_on_settings(settings: dict[str, str]) -> None:
    """Before the first collective of a transpiled step (and before its rings
    are created, which every rank must do alike): the ranks compare how they
    transpiled it; a difference raises on every rank."""
    everyone = all_gather_values(settings)
    for rank, theirs in enumerate(everyone):
        for key in everyone[0]:
            if theirs.get(key) != everyone[0][key]:
                raise TranspileError(
                    f"rank {rank} transpiled the step with {key} {theirs.get(key)} where rank 0 "
                    f"has {everyone[0][key]}; every rank must use the same mode and options")


def first_difference(a: list[str], b: list[str], first: str = "rank 0") -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"{first} has {x!r} where it has {y!r}"
    return f"{first} has {len(a)} collective and parameter entries, it has {len(b)}"
