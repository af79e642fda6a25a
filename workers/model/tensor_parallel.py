"""Tensor parallelism inside one worker: a model's heads and MLP columns split over ranks.

Megatron's layout. Each rank holds:

- q/k/v and gate/up (column-parallel): its heads' rows of the fused q/k/v weight, its slice of
  the MLP's intermediate columns. With fewer KV heads than ranks, each KV head is replicated:
  rank r holds KV head r * num_kv_heads // size, the one its query heads read.
- o_proj and down_proj (row-parallel): the matching input columns; the partial outputs are
  summed over the ranks (`all_reduce`), the one collective of each half of a layer.
- the embedding and the LM head (vocab-parallel): rows [r * V', (r + 1) * V') of the vocabulary
  (V' = ceil(V / size), the last shard zero-padded). A token outside a rank's rows embeds as
  zeros there and the ranks' embeddings are summed; the logits' shards are gathered on every
  rank, so each sampler sees the full logits (and, seeded alike, draws alike).
- the norms: whole (Qwen3's per-head q/k norms too: every head has the same one).
- o_proj's and down_proj's biases (attention_bias, Llama's mlp_bias): rank 0's alone; the others
  hold zeros, so the sum over the ranks adds each once.

A rank's model is then the model of `shard_config`: every other part of the engine (the KV
cache, the attention kernels, the memory plan) sees its own heads and nothing else changes.
The group: an engine's own ranks on one CPU node (workers/tp_group.py) reduce through shared
memory, else gloo; a torchrun's, whatever it initialised (NCCL on GPUs: untested).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.shm_collectives import ShmCollectives


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (size 1: no group, no collectives)."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    # One node's CPU ranks reduce through shared memory (workers/model/shm_collectives.py); None: gloo/NCCL.
    shm: ShmCollectives | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel: rank {self.rank} of size {self.size}")

    @classmethod
    def from_world(cls, size: int) -> TensorParallel:
        """The default process group as one TP group of `size` ranks (torchrun's layout). It must
        have been initialised (torch.distributed.init_process_group) with exactly `size` ranks."""
        if size == 1:
            return cls()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"tensor_parallel_size: {size} needs torch.distributed initialised first "
                             "(init_process_group, e.g. under torchrun), one process per rank")
        if dist.get_world_size() != size:
            raise ValueError(f"tensor_parallel_size: {size}, but the process group has {dist.get_world_size()} ranks")
        return cls(size, dist.get_rank(), None)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (each rank then holds the same values)."""
        if self.size > 1:
            if self.shm is not None and self.shm.fits(x):
                return self.shm.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The full [N, vocab_size] logits from each rank's [N, V'] shard, on every rank."""
        if self.size == 1:
            return logits
        if self.shm is not None and self.shm.fits(logits):
            return self.shm.all_gather(logits.contiguous())[:, :vocab_size]
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of this rank's vocabulary shard (rows past the vocabulary are padding)."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds of the full model's `cfg`."""
        if cfg.num_kv_heads >= self.size:
            per = cfg.num_kv_heads // self.size
            return self.rank * per, per
        return self.rank * cfg.num_kv_heads // self.size, 1


SINGLE = TensorParallel()  # one rank: no group, no collectives


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError unless `cfg` splits over `size` ranks."""
    if size == 1:
        return
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size: {size} and the model's {cfg.num_kv_heads} KV heads must divide "
                         "one another (KV heads are split, or replicated when fewer than the ranks)")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's intermediate size "
                         f"{cfg.intermediate_size}")
    if cfg.quantization is not None:
        raise ValueError(f"tensor_parallel_size: {size} with a {cfg.quantization} checkpoint is not supported yet "
                         "(--quantization fp8 on a 16/32-bit checkpoint is)")


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The decoder shape one rank computes: its query and KV heads, its intermediate columns
    (the vocabulary stays whole: the embedding and LM head shard it themselves)."""
    if tp.size == 1:
        return cfg
    check_shardable(cfg, tp.size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=tp.kv_heads(cfg)[1],
                               intermediate_size=cfg.intermediate_size // tp.size)


_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_ROW_BIAS = re.compile(r"\.(o_proj|down_proj)\.bias$")
_VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` of the full model `cfg` (the whole tensor
    when it is replicated: the norms; zeros for o_proj's and down_proj's biases beyond rank 0)."""
    if tp.size == 1:
        return tensor
    hd = cfg.head_dim
    if (m := _COLUMN.search(name)) is not None:
        proj = m.group(1)
        if proj == "q_proj":
            per = cfg.num_heads // tp.size
            return tensor.narrow(0, tp.rank * per * hd, per * hd)
        if proj in ("k_proj", "v_proj"):
            first, n = tp.kv_heads(cfg)
            return tensor.narrow(0, first * hd, n * hd)
        per = cfg.intermediate_size // tp.size
        return tensor.narrow(0, tp.rank * per, per)
    if (m := _ROW.search(name)) is not None:
        per = (cfg.num_heads * hd if m.group(1) == "o_proj" else cfg.intermediate_size) // tp.size
        return tensor.narrow(1, tp.rank * per, per)
    if _ROW_BIAS.search(name):  # added to each rank's partial sum: once in all, by rank 0
        return tensor if tp.rank == 0 else torch.zeros_like(tensor)
    if _VOCAB.match(name):
        first, rows = tp.vocab_shard(cfg.vocab_size)
        part = tensor[first : first + rows]
        if part.shape[0] < rows:  # the last shard's padding: zero rows (no token maps there)
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part
    return tensor
