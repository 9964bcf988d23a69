"""One logical runner made of N ranks (mlx.distributed): rank 0 is the runner the supervisor
knows; ranks 1..N-1 follow it step by step.

Tensor parallelism (mlx-lm's `Model.shard`): every rank holds a slice of every layer and the
layers' all_sum collectives join them, so every rank must run the same forward passes, on the
same inputs, with the same KV cache layout, in the same order. Rank 0 keeps the whole engine
(HTTP, scheduler, block pool decisions, sampling, stop strings, grammars); before each step's
forward passes it sends the followers one message with:
- the block pool's operations since the last step (`admit`, `reserve`, `commit`, `release`,
  `reset`: the pool is deterministic, so replaying them gives each follower the same block
  tables, prefix sharing and evictions), and the model step's own (`admit` a sequence's
  cache, `reset` after a failed step);
- the step: the sequences released, each decode row's input token, each prefill chunk's token
  ids and bounds.

The message travels by the same collectives (`Channel`: two all_sum calls in which the
followers add zeros), so no transport of our own is involved. Sampling stays on rank 0: with
the head not sharded, only rank 0 computes logits; followers run the model body only.

Invariants (checked by the tests against the single-process runner, token for token):
- Every rank evaluates the same graphs in the same order: in lockstep mode the model step
  evaluates each forward pass alone (decode first, then each prefill chunk) and never runs a
  decode step ahead, so collectives never interleave across passes.
- Nothing but `ModelStep.run` runs a forward pass on rank 0 after loading (embeddings and
  images are refused for a sharded model).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import orjson

from mlxr.runner.distributed import doorbell

log = logging.getLogger("mlxr.runner")

POOL_OPS = frozenset({"reset", "admit", "reserve", "commit", "release"})


def join_group(config: Any) -> Any:
    """This process's group when started as a rank, else None: the rank and ring from the
    config (the supervisor's way), else MLX_RANK and MLX_HOSTFILE (mlx.launch's). The backend
    is MLXR_DISTRIBUTED_BACKEND, default the ring."""
    if config.ring:
        if not 0 <= config.rank < len(config.ring):
            raise ValueError(f"rank {config.rank} is not one of the ring's {len(config.ring)}")
        fd, path = tempfile.mkstemp(prefix="mlxr-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(orjson.dumps([[address] for address in config.ring]).decode())
        os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(config.rank), path
    if os.environ.get("MLX_RANK") is None:
        return None
    backend = os.environ.get("MLXR_DISTRIBUTED_BACKEND", "ring")
    try:
        group = mx.distributed.init(backend=backend, strict=True)
    finally:
        if config.ring:  # read by init; a runner stopped by a signal would leave it behind
            _unlink(os.environ.pop("MLX_HOSTFILE"))
    log.info("distributed: rank %d of %d (%s)", group.rank(), group.size(), backend)
    return group if group.size() > 1 else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _tensor_splits(model: Any, ranks: int) -> bool:
    """mlx-lm's `shard` divides the attention heads, the KV heads and the MLP among ranks."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", 0)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    mlp = getattr(args, "intermediate_size", 0)
    return hasattr(model, "shard") and heads > 0 and \
        all(n % ranks == 0 for n in (heads, kv_heads, mlp))


def shard(model: Any, group: Any, how: str = "auto") -> str:
    """Shard a lazily loaded model over `group` as mlx-lm does for its architecture, and say
    how: "tensor" (every rank a slice of every layer: `Model.shard`) where the heads divide
    among the ranks, else "pipeline" (every rank a run of whole layers:
    `model.model.pipeline`). `how` forces one."""
    ranks = group.size()
    kind = type(model).__module__.rsplit(".", 1)[-1]
    tensor = _tensor_splits(model, ranks)
    pipeline = hasattr(getattr(model, "model", None), "pipeline") and \
        len(model.model.layers) >= ranks
    if how == "auto":
        how = "tensor" if tensor else "pipeline" if pipeline else ""
    if how == "tensor" and tensor:
        model.shard(group)
    elif how == "pipeline" and pipeline:
        model.model.pipeline(group)
    else:
        raise ValueError(f"mlx-lm cannot shard this {kind} model over {ranks} ranks"
                         + (f" by {how}" if how else "") + " (tensor: the attention heads, "
                         "KV heads and MLP width must divide among the ranks; pipeline: the "
                         "architecture must support it, with a layer per rank)")
    return how


class Channel:
    """Bytes from rank 0 to every rank, carried by all_sum (the others add zeros)."""

    def __init__(self, group: Any):
        self.group = group

    def send(self, payload: bytes) -> None:
        self._exchange(payload)

    def receive(self) -> bytes:
        return self._exchange(None)

    def _exchange(self, payload: bytes | None) -> bytes:
        size = mx.distributed.all_sum(mx.array([len(payload) if payload else 0], mx.int32),
                                      group=self.group).item()
        if size == 0:
            return b""
        buf = mx.array(np.frombuffer(payload, np.uint8)) if payload else mx.zeros((size,),
                                                                                  mx.uint8)
        return bytes(np.array(mx.distributed.all_sum(buf, group=self.group)))


def _ints(values) -> list[int]:
    return [int(v) for v in values]


class RecordingPool:
    """The block pool as the scheduler and engine see it on rank 0: its mutating calls are
    logged for the followers, everything else passes through."""

    def __init__(self, pool: Any, ops: list):
        self._pool = pool
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._pool, name)
        if name not in POOL_OPS:
            return attr

        def recorded(*args):
            self._ops.append(["pool." + name, *[_ints(a) if isinstance(a, (list, tuple))
                                                else a for a in args]])
            return attr(*args)
        return recorded


class Leader:
    """Rank 0's side: records and sends; the engine calls `admit`, `run`, `reset` and `stop`
    instead of the model step's own."""

    def __init__(self, group: Any, step: Any, config: Any):
        self.channel = Channel(group)
        self.step = step
        self.ops: list = []
        step.lockstep = True
        self.hosts = doorbell.ring_hosts(config, group.size())
        self.doorbells = doorbell.exchange_ports(group, 0)
        self.parked = False

    def park(self) -> None:
        """Nothing to run: let the followers sleep until the next message (doorbell.py)."""
        if not self.parked:
            self._send({"park": True})
            self.parked = True

    def setup(self, pool: Any) -> RecordingPool:
        """Tell the followers the pool's size (they make theirs alike); returns the pool the
        scheduler must use."""
        self._send({"setup": {"num_blocks": pool.num_blocks, "block_size": pool.block_size}})
        return RecordingPool(pool, self.ops)

    def admit(self, seq: Any, admission: Any) -> int:
        self.ops.append(["step.admit", seq.seq_id])
        return self.step.admit(seq, admission)

    def reset(self) -> None:
        self.ops.append(["step.reset"])
        self.step.reset()

    def run(self, plan: Any) -> Any:
        self._send({"ops": self.ops, "step": {
            "release": [s.seq_id for s in plan.release],
            "decode": [[s.seq_id, int(s.output_tokens[-1])] for s in plan.decode],
            "prefills": [[c.seq.seq_id, c.start, c.end, c.is_last,
                          _ints(c.seq.all_tokens[c.start:c.end])] for c in plan.prefills]}})
        self.ops.clear()
        return self.step.run(plan)

    def stop(self) -> None:
        self._send({"stop": True})

    def _send(self, message: dict) -> None:
        if self.parked:
            doorbell.ring(self.hosts, self.doorbells)
            self.parked = False
        self.channel.send(orjson.dumps(message))


@dataclass(slots=True)
class _Shadow:
    """A follower's stand-in for a sequence: the cache and the model step know sequences by
    id only."""
    seq_id: int


class Follower:
    """Ranks 1..N-1: replay rank 0's operations and run the same forward passes (the model
    body only) until rank 0 says stop."""

    def __init__(self, group: Any, step: Any, config: Any):
        self.channel = Channel(group)
        self.step = step
        self.pool: Any = None
        self.admissions: dict[int, Any] = {}
        self.steps = 0
        step.lockstep = True
        self.doorbell = doorbell.Doorbell(doorbell.ring_hosts(config, group.size())[group.rank()])
        doorbell.exchange_ports(group, self.doorbell.port)

    def serve(self) -> None:
        while True:
            message = orjson.loads(self.channel.receive())
            if message.get("stop"):
                log.info("distributed: rank 0 stopped after %d steps", self.steps)
                return
            if message.get("park"):
                self.doorbell.wait()
                continue
            if "setup" in message:
                setup = message["setup"]
                self.pool = self.step.make_pool(setup["num_blocks"], setup["block_size"])
                continue
            for op in message["ops"]:
                self._apply(op)
            self._forward(message["step"])
            self.steps += 1

    def _apply(self, op: list) -> None:
        name, args = op[0], op[1:]
        if name == "step.admit":
            self.step.admit(_Shadow(args[0]), self.admissions.pop(args[0]))
        elif name == "step.reset":
            self.step.reset()
        else:
            result = getattr(self.pool, name.removeprefix("pool."))(*args)
            if name == "pool.admit" and result is not None:
                self.admissions[args[0]] = result

    def _forward(self, step: dict) -> None:
        self.step.follow([_Shadow(i) for i in step["release"]],
                         [token for _, token in step["decode"]],
                         [(_Shadow(i), start, end, last, tokens)
                          for i, start, end, last, tokens in step["prefills"]])
