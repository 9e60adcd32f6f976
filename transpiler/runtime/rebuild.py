"""Rank agreement on rebuilt programs, when only some ranks may rebuild.

A step traces again when a call's signature is new (program_cache.py), and
that can happen on some ranks only (a short last batch on one of them). The
other ranks are then already inside the previous program's collectives: an
exchange on the control plane would wait alone until the process group's
timeout. So, after the first build (agreed by every rank, agreement.agree):

- A rebuilt program whose collective summary (agreement.collective_summary:
  collectives, parameter and buffer shapes; not the batch's) every rank has
  agreed on before runs with no exchange, as DDP trains on with a short batch:
  its collectives pair with the others'. Its compile is not exchanged either
  (compile_alone); a failure there abandons the job.
- A rebuilt program with new collectives, or a rebuild that failed, meets the
  others at a rendezvous on the default group's store: each rank that rebuilds
  posts its outcome and waits for the others'. If every rank posts within a
  grace period (they all rebuilt: a layer frozen on every rank), they compare
  as at the first build. If one does not, it runs the previous program and
  waits in its collectives: the job is abandoned. The reason is posted to the
  store and this process's communicators are destroyed (rings.shut_down),
  which makes the ranks waiting in them fail at once; executor.py then reads
  the reason (raise_if_abandoned) and raises it. Nothing is committed on any
  rank, and the job cannot go on (its communicators are gone).

Rendezvous are numbered in the order a process enters them (the same on every
rank while they rebuild alike); a rank that never entered the one that was
abandoned reads its reason under the number it would give the next.
"""

from __future__ import annotations

import logging
import pickle
import time

import torch.distributed as dist

from . import agreement
from ..lowering import rings
from ..errors import TranspileError
from ..program.program import Program
from ..world import group, per_group, world, world_timeout

log = logging.getLogger("transpiler")

_DEFAULT_TIMEOUT_S = 1800.0   # torch's default for gloo
_POLL_S = 0.02
_ABANDONED = b"abandoned\n"


def grace_seconds() -> float:
    """How long a rank that rebuilt with new collectives waits for the others
    to rebuild too: a tenth of the process group's timeout, at most 30 s.
    Ranks that all rebuild arrive within a step's host time of each other; a
    rank that does not arrive is waiting in the previous program."""
    timeout = world_timeout()
    seconds = _DEFAULT_TIMEOUT_S if timeout is None else timeout.total_seconds()
    return min(30.0, seconds / 10)


class AgreedPrograms:
    """A step's collective summaries every rank has agreed on, by digest."""

    def __init__(self):
        self._summaries: dict[str, list[str]] = {}
        self._last: list[str] = []   # the summary agreed last

    def settle(self, programs: list[Program], error: BaseException | None, why: str,
               new_state: bool, everyone: bool = False) -> bool:
        """Agree on a build (its programs, or the error it hit; `why` it was
        built; `new_state`: it runs on parameters never broadcast, so its
        startup program would be a collective; `everyone`: every rank is known
        to be building now). True when it runs with no exchange: its programs
        compile alone."""
        _raise()   # abandoned before: the communicators are gone
        status, digest, summary = mine = agreement.outcome(programs, error)
        if status == "ok" and digest in self._summaries and not new_state and not everyone:
            log.info("transpiler: the rebuilt programs' collectives were agreed before: "
                     "running on without an exchange")
            return True
        if not self._summaries or everyone:   # every rank is building
            agreement.agree(programs, error)
        else:
            self._rendezvous(mine, error, why)
        self._summaries[digest] = self._last = summary
        return False

    def _rendezvous(self, mine: tuple, error: BaseException | None, why: str) -> None:
        world_size, rank = world()
        prefix = _current()
        _state().entered += 1
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{prefix}/{rank}", pickle.dumps((*mine, why)))
        keys = [f"{prefix}/{r}" for r in range(world_size)]
        decision = f"{prefix}/decision"
        deadline = time.monotonic() + grace_seconds()
        while not store.check(keys) and not store.check([decision]) \
                and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        decided = store.compare_set(decision, b"", _ABANDONED + self._abandon_message(
            rank, mine, error, why, missing).encode() if missing else b"agreed")
        _raise(decided)
        agreement.compare([pickle.loads(store.get(k))[:3] for k in keys], error)

    def _abandon_message(self, rank: int, mine: tuple, error: BaseException | None,
                         why: str, missing: list[int]) -> str:
        _, shown, summary = mine   # shown: the digest, or the error
        if error is not None:
            what = f"could not build the step again ({why}): {shown}"
        else:
            what = (f"traced the step again ({why}) and its programs' collectives differ "
                    f"from those the ranks agreed on (the agreed "
                    f"{agreement.first_difference(self._last, summary, 'program')})")
        ranks = ", ".join(map(str, missing))
        return (f"rank {rank} {what}, while rank{'s' if len(missing) > 1 else ''} {ranks} "
                f"ran on with the previous program (it did not trace again within "
                f"{grace_seconds():.0f}s). "
                "Every rank must issue the same collectives: make the same change on every "
                "rank at the same step. The communicators were shut down so that no rank "
                "waits for the process group's timeout: this job cannot go on; restart it.")


def abandon(message: str, cause: BaseException) -> None:
    """Abandon the job from a rank that cannot run a program the others run
    (its compile alone failed): post `message` for the others, shut the
    communicators down, raise it (or the reason posted first)."""
    store = dist.distributed_c10d._get_default_store()
    _raise(store.compare_set(f"{_current()}/decision", b"", _ABANDONED + message.encode()), cause)


def raise_if_abandoned(exc: BaseException) -> None:
    """After a program failed: if a rank abandoned the job (the failure is its
    communicators going away), raise the reason it posted, from `exc`, after
    shutting this rank's communicators down too (a rank waiting on this one
    in a ring then fails as well)."""
    if world()[0] == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    decision = f"{_current()}/decision"
    abandoned = _state().abandoned
    if abandoned is not None or store.check([decision]):
        _raise(store.get(decision) if abandoned is None else b"", exc)


class _State:
    """Per step's group: the rendezvous entered so far, and the reason the
    job was abandoned (once it was)."""

    def __init__(self):
        self.entered = 0
        self.abandoned: str | None = None


_states: dict = {}   # world.per_group


def _state() -> _State:
    return per_group(_states, _State)


def _current() -> str:
    """The store prefix of the next rendezvous on the step's group."""
    return f"transpiler/rebuild/{group().group_name}/{_state().entered}"


def _raise(decided: bytes = b"", cause: BaseException | None = None) -> None:
    """If `decided` (a rendezvous's decision) abandons the job, or it was
    abandoned before: shut the communicators down once and raise the reason."""
    state = _state()
    if state.abandoned is None:
        if not decided.startswith(_ABANDONED):
            return
        state.abandoned = decided[len(_ABANDONED):].decode()
        rings.shut_down()
    raise TranspileError(state.abandoned) from cause
