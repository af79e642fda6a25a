"""Load HF safetensors checkpoints (one file, or shards with an index) into the
fused-layout model in place: the parameters are allocated once, in the target
dtype on the target device, and each checkpoint tensor is read, cast and copied
into its (slice of a fused) parameter, then dropped. Peak memory on the device
is the weights; on the host, one checkpoint tensor (and its cast) besides."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode
from tqdm import tqdm

from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers.model import fp8, packed_linear
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.llama import DecoderLayer, LlamaForCausalLM
from pdserve.workers.model.tensor_parallel import SINGLE, TensorParallel, shard_config, shard_tensor

# checkpoint projection -> (fused parameter, which shard of it)
log = logging.getLogger(__name__)

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PROJ = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
# Buffers some older checkpoints carry that we recompute.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# What fp8 checkpoints carry beside the weights and their scales that is not used: static
# activation scales (activations are scaled per token: workers/model/fp8.py).
_FP8_IGNORED = re.compile(r"\.(input_scale|output_scale|q_scale)$")
# Calibrated fp8 KV-cache scales (vLLM's names): an fp8 KV cache stores K / k_scale, V / v_scale.
# Where fp8 checkpoints keep them: `self_attn.k_scale`, `k_proj.k_scale`, the output scale of the
# K and V projections (`k_proj.output_scale`, as vLLM maps it to k_scale), or, in older ones, one
# `kv_scale` for both.
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:(?:k_proj\.|v_proj\.)?([kv])_scale"
                       r"|([kv])_proj\.output_scale|(kv)_scale)$")
_FP8_SCALE = re.compile(r"\.weight_scale(_inv)?$")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors weights in {model_dir}")
    return files


def head_differs(files: list[Path], rows: int = 4096) -> bool:
    """Whether the checkpoint holds an `lm_head.weight` that is not its embedding (compared
    `rows` rows at a time: one row block of each in memory)."""
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                if name in st.keys():
                    where[name] = f
    if len(where) < 2:
        return False
    with safe_open(str(where["lm_head.weight"]), framework="pt", device="cpu") as head_file, \
            safe_open(str(where["model.embed_tokens.weight"]), framework="pt", device="cpu") as embed_file:
        head, embed = head_file.get_slice("lm_head.weight"), embed_file.get_slice("model.embed_tokens.weight")
        if head.get_shape() != embed.get_shape() or head.get_dtype() != embed.get_dtype():
            return True
        n = head.get_shape()[0]
        return any(not torch.equal(head[i:i + rows], embed[i:i + rows]) for i in range(0, n, rows))


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
    backend: AttentionBackend, max_positions: int, progress: bool = False, quantization: str | None = None,
    tp: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    """Build the model on the meta device, allocate its parameters empty in `dtype`
    on `device`, fill them tensor by tensor from the checkpoint. An fp8 checkpoint
    (`cfg.quantization`) loads its e4m3 weights as they are; `quantization="fp8"` quantizes a
    16/32-bit one's linear weights once loaded (workers/model/fp8.py). With `tp` of more than one
    rank, `cfg` is the whole model's and this rank loads its shard (workers/model/tensor_parallel.py)."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    if cfg.tie_word_embeddings and head_differs(files):
        # transformers does the same: a fine-tune that trained its head apart kept the tied config
        log.warning("model: %s says tie_word_embeddings but its lm_head.weight differs from its embedding: "
                    "loaded untied, as transformers loads it", model_dir)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    full_cfg, cfg = cfg, shard_config(cfg, tp)
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization: must be fp8 or None, got {quantization!r}")
    fp8_checkpoint = cfg.quantization == "fp8"
    with torch.device("meta"), _NoDrawOnMeta():
        model = LlamaForCausalLM(cfg, backend, max_positions, tp)
        if fp8_checkpoint:
            _fp8_modules(model, _e4m3_layers(files))
    _materialise(model, dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    # parameter name -> shards still to load (fused parameters have several)
    missing = {n: _num_shards(n) for n in dict(model.named_parameters())}
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="loading weights",
               disable=not progress, file=sys.stderr)
    fp8_parts: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its e4m3 weight and scale, until both came
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if (kv := _KV_SCALE.match(name)) is not None:  # before the ignored: output_scale is one
                    which = kv.group(2) or kv.group(3) or kv.group(4)
                    for one in which:  # "kv": the same scale for both
                        _set_kv_scale(model, int(kv.group(1)), one, st.get_tensor(name))
                    continue
                if _IGNORED.search(name) or (fp8_checkpoint and _FP8_IGNORED.search(name)):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                tensor = st.get_tensor(name)
                if fp8_checkpoint and (_FP8_SCALE.search(name) or tensor.dtype == fp8.E4M3):
                    layer, part = name.rsplit(".", 1)
                    fp8_parts.setdefault(layer, {})["weight" if part == "weight" else "scale"] = tensor
                    if len(fp8_parts[layer]) == 2:
                        for target in _load_fp8(params, cfg, layer, fp8_parts.pop(layer)):
                            missing[target] = missing.get(target, 1) - 1
                    continue
                # Cast on the host (one tensor's worth), then one copy to the device: no
                # device memory beyond the parameter it lands in.
                target = _load_one(params, cfg, name, shard_tensor(name, tensor, full_cfg, tp).to(dtype))
                missing[target] = missing.get(target, 1) - 1
        bar.update(f.stat().st_size)
    bar.close()
    if fp8_parts:
        raise ValueError(f"model: fp8 checkpoint in {model_dir} has weights without scales (or scales without "
                         f"weights): {sorted(fp8_parts)[:5]}")
    missing = {n: left for n, left in missing.items() if left > 0}
    if missing:
        raise ValueError(f"model: checkpoint in {model_dir} lacks weights for {sorted(missing)[:5]}")
    model.model.rotary.build(device, dtype)
    del params  # its references would keep each plain weight alive while it is quantized or packed
    if quantization == "fp8" and not fp8_checkpoint:
        fp8.quantize_linears(model)
    if device.type == "cpu":
        _cpu_linears(model, dtype)
    if device.type == "cuda":
        # Blocks freed while loading (casts, the rotary tables' temporaries) would stay in
        # torch's cache and look used to mem_get_info when the KV pool is sized.
        torch.cuda.empty_cache()
    return model.eval()


class _NoDrawOnMeta(TorchFunctionMode):
    """While modules are built on the meta device, their random init draws nothing. The draw
    computes nothing there anyway, yet it runs torch's Python reference of `normal_`/`uniform_`,
    whose first call imports torch._dynamo: 1-2.5 s of every eager worker's start (the weights
    come from the checkpoint). A function mode is the building thread's alone: another
    thread's modules draw as ever."""

    _DRAWS = frozenset({torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_,
                        torch.nn.init.kaiming_normal_, torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_,
                        torch.nn.init.trunc_normal_, torch.Tensor.normal_, torch.Tensor.uniform_})

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
        if func in self._DRAWS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def _materialise(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter and buffer with an uninitialised one of `dtype` (floating
    point ones, but those a module keeps in a dtype of their own: fp8 weights and their
    scales) on `device`: the one allocation of the weights. A parameter shared by two
    modules (tied embeddings) stays shared: it is allocated once."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        own: dict[str, torch.dtype] = getattr(module, "own_dtypes", {})
        for key, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in done:
                kind = own.get(key) or (dtype if param.is_floating_point() else param.dtype)
                done[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                                     requires_grad=False)
            module._parameters[key] = done[id(param)]
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = torch.empty(buf.shape, dtype=dtype if buf.is_floating_point() else buf.dtype,
                                                   device=device)


def _cpu_linears(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Lay the linear weights out for the CPU's GEMMs. A tied lm_head gets its own copy
    first, so the embedding keeps plain rows to gather.

    float32 weights from 1 MiB (none when the model's float32 linears all fit in the CPU's
    last-level cache: packed_linear.float32_floor), and bfloat16 where oneDNN runs it:
    oneDNN-packed (packed_linear.py). Every other float32 or float16 [out, in] weight (and all of them with
    packing off: PDSERVE_CPU_PACKED_LINEAR=0) is stored as the transpose of a contiguous
    [in, out] matrix: MKL's `x @ W.T` then runs without a transposed operand, much faster at
    the small-batch decode shapes than the plain layout (docs/performance.md, "The engine's
    CPU step"); bfloat16 keeps the plain layout, which measured faster than this one for it
    (docs/engine.md). The float32 ones among these run steps of up to 16 rows on pdserve's own
    op (pdserve/kernels/cpu_linear.py) where it builds, and MKL beyond.
    """
    if model.config.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone(), requires_grad=False)
    if packed_linear.supported(dtype, torch.device("cpu")):
        packed_linear.pack_linears(model, packed_linear.float32_floor(model))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and dtype is not torch.bfloat16:
            module.weight.data = module.weight.data.t().contiguous().t()
            packed_linear.use_cpu_linear_op(module)


def _load_one(params: dict[str, torch.nn.Parameter], cfg: ModelConfig, name: str, tensor: torch.Tensor) -> str:
    """Copy one checkpoint tensor into its (slice of a) parameter; return the parameter name."""
    match = _PROJ.search(name)
    if match is None:
        if name not in params:
            raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        return name
    fused, shard = _FUSED[match.group(1)]
    target = name.replace(match.group(0), f".{fused}.")
    if fused == "qkv_proj":
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    start = sum(sizes[:shard])
    fused_param = params.get(target)
    if fused_param is None:
        raise ValueError(f"model: unexpected weight {name!r} in checkpoint")
    dest = fused_param.narrow(0, start, sizes[shard])
    if dest.shape != tensor.shape:
        raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)
    return target


def _set_kv_scale(model: LlamaForCausalLM, layer: int, which: str, tensor: torch.Tensor) -> None:
    """A checkpoint's calibrated K or V scale of an fp8 KV cache, for layer `layer`."""
    if tensor.numel() != 1 or not 0 < float(tensor) < float("inf"):
        raise ValueError(f"model: layer {layer}'s {which}_scale must be one positive number, got "
                         f"{tuple(tensor.shape)}")
    decoder = model.model.layers[layer]
    assert isinstance(decoder, DecoderLayer)
    attn = decoder.self_attn
    k, v = attn.kv_scales
    attn.kv_scales = (float(tensor), v) if which == "k" else (k, float(tensor))


def _e4m3_layers(files: list[Path]) -> set[str]:
    """The (fused) module names whose weights an fp8 checkpoint holds in e4m3, read from the
    files' headers. Not all of them are: the layers in its `ignore` / `ignored_layers` list stay
    16/32-bit, and vLLM loads those as plain linears. A fused layer whose parts disagree
    (q_proj e4m3, k_proj not) is refused, as vLLM refuses it."""
    kinds: dict[str, set[bool]] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if not name.endswith(".weight"):
                    continue
                layer = name[: -len(".weight")]
                if (match := _PROJ.search(name)) is not None:
                    layer = name.replace(match.group(0), f".{_FUSED[match.group(1)][0]}.")[: -len(".weight")]
                kinds.setdefault(layer, set()).add(st.get_slice(name).get_dtype() == "F8_E4M3")
    mixed = sorted(layer for layer, kind in kinds.items() if len(kind) > 1)
    if mixed:
        raise ValueError(f"model: fp8 checkpoint has fused layers with some parts in e4m3 and some not: {mixed[:5]}")
    return {layer for layer, kind in kinds.items() if True in kind}


def _fp8_modules(model: LlamaForCausalLM, e4m3: set[str]) -> None:
    """(On the meta device.) The decoder's linear layers whose weights the checkpoint holds in
    e4m3 (`e4m3`: module names) as Fp8Linear: an fp8 checkpoint's weights land in them as they are."""
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, torch.nn.Linear) and name in fp8.DECODER_LINEARS
                    and f"{prefix}.{name}" in e4m3):
                setattr(parent, name, fp8.Fp8Linear(child.in_features, child.out_features, child.bias is not None))


def _load_fp8(params: dict[str, torch.nn.Parameter], cfg: ModelConfig, layer: str,
              parts: dict[str, torch.Tensor]) -> list[str]:
    """One fp8 layer's weight and scale (per tensor, per channel or per block) into its (slice
    of a fused) Fp8Linear as e4m3 rows and one scale per row; the parameter names it filled."""
    weight, scale = parts["weight"], parts["scale"]
    if weight.dtype != fp8.E4M3:
        raise ValueError(f"model: {layer}.weight is {weight.dtype}, expected float8_e4m3fn in an fp8 checkpoint")
    block = cfg.fp8_block
    # A layer no wider than one block (in_features <= bk) has one column of block scales,
    # [ceil(out / bn), 1]: per block all the same, not per channel (that would be [out, 1]).
    one_wide = (block is not None and scale.dim() == 2
                and tuple(scale.shape) == (-(-weight.shape[0] // block[0]), 1) and weight.shape[1] <= block[1])
    if scale.dim() == 2 and (scale.shape[1] > 1 or one_wide):  # per block
        if cfg.fp8_block is None:
            raise ValueError(f"model: {layer} has block scales {tuple(scale.shape)} but the config no block size")
        weight, rows = fp8.requantize_blocks(weight, scale, cfg.fp8_block)
    else:
        rows = fp8.row_scales(scale, weight.shape[0])
    return [_load_one(params, cfg, f"{layer}.weight", weight), _load_one(params, cfg, f"{layer}.weight_scale", rows)]


def _num_shards(param_name: str) -> int:
    if param_name.endswith(("qkv_proj.weight", "qkv_proj.bias", "qkv_proj.weight_scale")):
        return 3
    return 2 if param_name.endswith(("gate_up_proj.weight", "gate_up_proj.bias", "gate_up_proj.weight_scale")) else 1
