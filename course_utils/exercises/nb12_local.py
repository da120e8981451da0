"""The judges of notebook 12's exercises that run no ranks (12.2, 12.6, 12.7, 12.9 to 12.12);
``nb12`` lists them in its bank with the others."""

from __future__ import annotations

from typing import Any

from .answers import NOT_A_NUMBER, real, whole

#: 12.2: (rows, world size), including sizes that do not divide evenly, and no rows at all
SHARD_CASES = [(n, w) for n in (10, 7, 12, 3, 1, 0) for w in (1, 2, 3, 4)]
#: 12.6: the models, each with parameters that forward never uses
NO_GRAD_MODELS = ("TwoHeads", "a stack whose middle layer is skipped")
#: 12.9: calls in a row, the random generators seeded alike before each
STORE_CALLS = 2


# ----------------------------------------------------------------------------- 12.2 exact shards

def _judge_shards(shard: Any) -> str | None:
    for n, world_size in SHARD_CASES:
        shards = [_indices(shard(n, rank, world_size)) for rank in range(world_size)]
        if any(s is None for s in shards):
            return f"with {n} rows on {world_size} ranks, return a list of row indices (whole numbers)"
        flat = [i for s in shards for i in s]
        twice = sorted({i for i in flat if flat.count(i) > 1})
        if twice:
            return (f"with {n} rows on {world_size} ranks, rows {twice} are evaluated by more "
                    f"than one rank: padding counts them twice in the metric")
        missing = sorted(set(range(n)) - set(flat))
        if missing:
            return (f"with {n} rows on {world_size} ranks, rows {missing} are never evaluated: "
                    f"the remainder must go somewhere")
        if sorted(flat) != list(range(n)):
            return f"with {n} rows the shards hold indices outside 0..{n - 1}: {sorted(flat)}"
        sizes = [len(s) for s in shards]
        if max(sizes) - min(sizes) > 1:
            return (f"with {n} rows on {world_size} ranks the shards hold {sizes} rows: every row is "
                    "evaluated once, but one rank does the work of several while the others wait; "
                    "spread the rows so that shards differ by at most one")
    return None


def _indices(rows: Any) -> list[int] | None:
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
        return None
    got = [whole(i) for i in rows]
    return None if None in got else got  # type: ignore[return-value]


# ----------------------------------------------------------------------------- 12.6 no gradient

class _SkipsMiddle:
    """12.6's second model: a stack whose middle layer forward skips (built on first use)."""

    def __new__(cls) -> Any:
        import torch

        class SkipsMiddle(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.first, self.middle, self.last = (torch.nn.Linear(4, 4) for _ in range(3))

            def forward(self, x: Any) -> Any:
                return self.last(torch.relu(self.first(x)))

        return SkipsMiddle()


def _judge_no_grad(params_without_grad: Any) -> str | None:
    import torch

    from course_utils.ddp.demos import TwoHeads

    for build, expected in ((TwoHeads, ["unused_head.bias", "unused_head.weight"]),
                            (_SkipsMiddle, ["middle.bias", "middle.weight"])):
        torch.manual_seed(0)
        model = build()
        loss = model(torch.randn(2, 4)).square().mean()
        got = sorted(params_without_grad(model, loss))
        if got == expected:
            continue
        everything = sorted(name for name, _ in model.named_parameters())
        if got == everything:
            return "every parameter is listed: no gradient exists until backward has run"
        if got == sorted(set(everything) - set(expected)):
            return "those are the parameters that did get a gradient; list the others"
        return (f"for {type(model).__name__}, got {got}: list the parameters that backward did not "
                "reach (forward never used them), whatever the model; every parameter here requires "
                "a gradient")
    return None


# ----------------------------------------------------------------------------- 12.7 seeds

def _judge_still_differ(still_differ: Any) -> str | None:
    if not isinstance(still_differ, (set, frozenset, list, tuple)):
        return "answer with a set of names, such as {\"weights\"}"
    got = set(still_differ)
    known = {"weights", "dropout mask", "data order"}
    if got - known:
        return f"choose among {sorted(known)}; {sorted(got - known)} is not one of them"
    if "weights" in got:
        return "DDP's constructor broadcasts rank 0's parameters and buffers: the weights agree after it"
    if got != {"dropout mask", "data order"}:
        return ("DDP copies tensors, not random generators: of the three, which are drawn at random on "
                "each rank after the model is wrapped?")
    return None


# ----------------------------------------------------------------------------- 12.9 ports

def _seed_every_generator() -> None:
    """The random generators a learner might draw a port from, all in the same state."""
    import random

    import numpy
    import torch

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


def _ephemeral_ports() -> range | None:
    """The ports this machine's OS hands out for port 0 (Linux says; elsewhere None)."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def _judge_store(start_store: Any) -> str | None:
    stores = []
    try:
        for _ in range(STORE_CALLS):  # the first as one an interrupted cell left running
            _seed_every_generator()  # a port drawn at random comes out the same: taken
            stores.append(start_store())
    except Exception as err:  # noqa: BLE001 - an address in use, said in torch's words
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            return ("the store found its port taken (the second call, by the first store, as by "
                    "one an interrupted cell left running; a port drawn at random can be taken as "
                    "well): let the operating system pick a free port (port 0)")
        raise
    if not all(hasattr(store, "port") for store in stores):
        return ("start_store must return a working store every time, also when something holds a "
                f"port: it returned {[type(store).__name__ for store in stores]}")
    ports = [store.port for store in stores]
    if 0 in ports or len(set(ports)) < len(ports):
        return f"the stores should listen on different real ports, got {ports}"
    ephemeral = _ephemeral_ports()
    if ephemeral is not None and any(port not in ephemeral for port in ports):
        return ("the stores work, but on ports this code chose: any of them can be held by another "
                "program (or the next run); let the operating system pick a free port (port 0)")
    stores[-1].set("key", "value")
    if stores[-1].get("key") != b"value":
        return "the store does not keep what is set in it"
    del stores
    return None


# ----------------------------------------------------------------------------- 12.10 CUDA and fork

def _judge_start_methods(safe_after_cuda: Any) -> str | None:
    if not isinstance(safe_after_cuda, (set, frozenset, list, tuple)):
        return "answer with a set of start methods, such as {\"spawn\"}"
    got = set(safe_after_cuda)
    if got - {"fork", "spawn", "forkserver"}:
        return f"the start methods are 'fork', 'spawn' and 'forkserver'; {sorted(got)} has others"
    if "fork" in got:
        return ("a forked child is a copy of this process, CUDA state included, which it cannot "
                "use: that is 'Cannot re-initialize CUDA in forked subprocess'")
    if "spawn" not in got:
        return ("a start method is safe when the child does not copy this process: one of them "
                "starts from a fresh interpreter")
    if got != {"spawn", "forkserver"}:
        return ("a start method is safe when the child does not copy this process: besides a fresh "
                "interpreter, a child can come from a clean process started before CUDA was touched")
    return None


# ----------------------------------------------------------------------------- 12.11 compression

def _judge_ratio(fp16_bytes_ratio: Any) -> str | None:
    ratio = real(fp16_bytes_ratio)
    if ratio is None:
        return ("answer with a number, bytes per step with the fp16 hook / bytes with plain fp32: "
                + NOT_A_NUMBER)
    if abs(ratio - 0.5) < 1e-9:
        return None
    if abs(ratio - 2.0) < 1e-9:
        return "that ratio is upside down: bytes with the fp16 hook over bytes with plain fp32"
    if abs(ratio - 50) < 1e-9:
        return "answer with a fraction, not a percentage"
    if abs(ratio - 1.0) < 1e-9:
        return "the hook casts each bucket before the all-reduce: fewer bytes travel"
    return "count the bytes of one gradient value: float32 has 4, float16 has 2"


# ----------------------------------------------------------------------------- 12.12 Flight Recorder

def _judge_first_mismatch(first_mismatch: Any) -> str | None:
    from course_utils.debugging.flight_recorder import example_flight_records, first_mismatch_of

    what = "(the collective's number in the group, a rank)"
    if not (isinstance(first_mismatch, (tuple, list)) and len(first_mismatch) == 2):
        return f"write a pair: {what}"
    seq, rank = (whole(v) for v in first_mismatch)
    if seq is None or rank is None:
        return f"write both as whole numbers: {what}"
    records = example_flight_records()
    right_seq, right_rank = first_mismatch_of(records)
    numbers = sorted({e["collective_seq_id"] for r in records.values() for e in r["entries"]})
    if seq not in numbers:
        return f"the dumps hold the group's collectives numbered {numbers}: name one of them"
    if rank not in records:
        return f"the job has ranks 0 to {max(records)}: name one of them"
    if seq < right_seq:
        return ("at that collective every rank ran the same operation with the same sizes, and it "
                "finished everywhere: look further down")
    if seq > right_seq:
        return ("the ranks disagree there too, but an earlier collective already did: a hang begins at "
                "the first disagreement, and what follows only queued behind it")
    if rank != right_rank:
        return ("the right collective: at it two ranks ran the same thing and one did not; the "
                "operation's name is the same on all three, so read the sizes")
    return None
