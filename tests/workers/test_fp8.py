"""fp8 (e4m3) weights (workers/model/fp8.py): the format, the emulated product against float64,
checkpoints in the layouts vLLM and llm-compressor write (per tensor, per channel, per block)
loading exactly what they hold, and `quantization="fp8"` casting a float checkpoint at load.

The oracle for the product is float64 over the same quantized values; for a checkpoint, the
weights it holds (dequantized) against the engine's; for the model, the float32 model's logits
(fp8 noise) and its greedy pick wherever its top two are clearly apart."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import capture_logits, tiny_spec
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.workers.model import fp8
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.tiny.builder import TinyModelSpec

SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
QWEN2 = tiny_spec("qwen2", hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
QWEN3 = tiny_spec("qwen3", hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


def _llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64, progress=False, **kw)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (7 + 9 * i,), generator=g).tolist() for i in range(n)]


# -- the format and the product ------------------------------------------------------------------


def test_quantize_keeps_each_weight_within_e4m3_rounding_of_its_value() -> None:
    w = torch.randn(64, 96, dtype=torch.float64) * torch.logspace(-3, 1, 64, dtype=torch.float64)[:, None]
    q, scale = fp8.quantize(w)
    assert q.dtype is fp8.E4M3 and scale.dtype is torch.float32 and scale.shape == (64,)
    back = fp8.dequantize(q, scale).double()
    # 3 mantissa bits: half a unit in the last place is 2^-4 of the value (normals); below the
    # smallest normal (2^-6 of the scale unit) the spacing is 2^-9 of it.
    bound = torch.maximum(w.abs() * 2**-4, scale.double()[:, None] * 2**-10) * 1.0001
    assert ((back - w).abs() <= bound).all()
    # Each row's largest magnitude maps to the format's largest value.
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), fp8.E4M3_MAX))


def test_an_all_zero_row_quantizes_to_zeros_not_nan() -> None:
    w = torch.zeros(3, 16)
    w[1] = torch.randn(16)
    q, scale = fp8.quantize(w)
    back = fp8.dequantize(q, scale)
    assert torch.isfinite(back).all() and torch.equal(back[0], torch.zeros(16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_emulated_product_equals_float64_over_the_same_quantized_values(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 48, bias=True).requires_grad_(False)
    q = fp8.Fp8Linear.from_linear(layer)
    x = torch.randn(5, 96)
    got = fp8.fp8_linear(x.to(dtype), q).double()
    xq, x_scale = fp8.quantize_activations(x.to(dtype))
    ref = (xq.double() * x_scale.double()) @ fp8.dequantize(q.weight, q.weight_scale).double().t()
    ref = ref + layer.bias.double()
    tol = 1e-5 if dtype is torch.float32 else 2e-3
    assert torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item())
    # ...and within fp8 noise of the unquantized layer.
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert float((got - exact).norm() / exact.norm()) < 0.06


# -- checkpoints -----------------------------------------------------------------------------------


def _fp8_checkpoint(src: Path, dst: Path, layout: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Copy the float32 model at `src` to `dst` as an fp8 checkpoint in `layout` ("fp8-tensor":
    vLLM's format with per-tensor scales and static input scales; "ct-channel": llm-compressor's
    compressed-tensors with per-channel scales; "fp8-block": vLLM's block-scaled format).
    Returns, per checkpoint weight name, its e4m3 weight and scale as written."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    written: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        proj = name.split(".")[-2] if name.endswith(".weight") else ""
        if proj not in PROJECTIONS:
            out[name] = t
            continue
        stem = name[: -len(".weight")]
        w = t.float()
        if layout == "fp8-tensor":
            scale = (w.abs().max() / fp8.E4M3_MAX).reshape(())
            q = (w / scale).clamp(-448, 448).to(fp8.E4M3)
            out[f"{stem}.input_scale"] = torch.tensor(0.02)  # static activation scale: not used
            key = "weight_scale"
        elif layout == "ct-channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / fp8.E4M3_MAX)
            q = (w / scale).clamp(-448, 448).to(fp8.E4M3)
            key = "weight_scale"
        else:
            blocks = w.reshape(w.shape[0] // 16, 16, w.shape[1] // 16, 16)
            scale = blocks.abs().amax(dim=(1, 3)) / fp8.E4M3_MAX
            full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
            q = (w / full).clamp(-448, 448).to(fp8.E4M3)
            key = "weight_scale_inv"
        out[name], out[f"{stem}.{key}"] = q, scale.float()
        written[name] = (q, scale.float())
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
        "ct-channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                       "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                           "num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
                           "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                 "dynamic": True}}}},
        "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                      "weight_block_size": [16, 16]},
    }[layout]
    (dst / "config.json").write_text(json.dumps(config))
    return written


def _loaded_rows(llm: LLM, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's e4m3 rows and per-row scales that hold checkpoint weight `name`."""
    parts = name.split(".")
    proj, layer_idx = parts[-2], int(parts[2])
    layer = llm.engine.model.model.layers[layer_idx]
    block = layer.self_attn if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
    fused, shard = FUSED.get(proj, (proj, 0))
    module = getattr(block, fused)
    assert isinstance(module, fp8.Fp8Linear), f"{fused} is {type(module).__name__}"
    cfg = llm.engine.model_config
    sizes = {"qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
             "gate_up_proj": [cfg.intermediate_size] * 2}.get(fused, [module.out_features])
    start = sum(sizes[:shard])
    return module.weight[start : start + sizes[shard]], module.weight_scale[start : start + sizes[shard]]


@pytest.mark.parametrize("layout", ["fp8-tensor", "ct-channel", "fp8-block"])
def test_an_fp8_checkpoint_loads_the_weights_it_holds(model_dir: Path, tmp_path: Path, layout: str) -> None:
    written = _fp8_checkpoint(model_dir, tmp_path / layout, layout)
    assert ModelConfig.from_pretrained(tmp_path / layout).quantization == "fp8"
    llm = _llm(tmp_path / layout)
    for name, (q, scale) in written.items():
        rows, row_scale = _loaded_rows(llm, name)
        assert rows.dtype is fp8.E4M3
        if layout == "fp8-block":  # quantized again per row: within e4m3 rounding of what it holds
            full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
            held = q.float() * full
            got = fp8.dequantize(rows, row_scale)
            assert ((got - held).abs() <= held.abs() * 2**-4 + row_scale[:, None] * 2**-9 + 1e-12).all(), name
        else:  # the same bytes and the same scale, repeated per row
            assert torch.equal(rows.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(row_scale, scale.flatten().expand(rows.shape[0])), name
    out = llm.generate(_prompts(2), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def _logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    captured = capture_logits(llm)
    for p in prompts:
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return [c[0] for c in captured]


@pytest.mark.parametrize("spec", [SPEC, QWEN2], ids=["llama", "qwen2-bias"])
def test_quantization_fp8_casts_a_float_checkpoint_within_fp8_noise(
        make_model: Callable[[TinyModelSpec], Path], spec: TinyModelSpec) -> None:
    path = make_model(spec)
    plain, quant = _llm(path), _llm(path, quantization="fp8")
    linears = [m for m in quant.engine.model.modules() if isinstance(m, fp8.Fp8Linear)]
    assert len(linears) == 4 * spec.num_layers  # qkv, o, gate_up, down per layer; not the LM head
    assert all(m.weight.dtype is fp8.E4M3 for m in linears)
    assert not isinstance(quant.engine.model.lm_head, fp8.Fp8Linear)
    prompts = _prompts(6, seed=1)
    clear = 0
    for want, got in zip(_logits(plain, prompts), _logits(quant, prompts)):
        assert float((got - want).norm() / want.norm()) < 0.15  # e4m3 weights and activations: ~0.1 here
        top2 = want.topk(2).values
        if float(top2[0] - top2[1]) > 0.05 * float(want.abs().max()):
            clear += 1
            assert int(got.argmax()) == int(want.argmax())
    assert clear >= 2, "no prompt had a clear top token: the comparison checked nothing"


def test_quantization_fp8_on_qwen3_is_transformers_on_the_same_quantized_values(
        make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Qwen3 (q/k norms between the fused q/k/v projection and RoPE) quantized at load: the logits
    of transformers' Qwen3 whose decoder linears hold the same e4m3 weights and see the same
    per-token e4m3 activations."""
    from transformers import AutoModelForCausalLM

    path = make_model(QWEN3)
    prompts = _prompts(4, seed=1)
    got = _logits(_llm(path, quantization="fp8", enforce_eager=True), prompts)

    def fp8_input(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        q, scale = fp8.quantize_activations(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale).reshape(x.shape),)

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.weight.copy_(fp8.dequantize(*fp8.quantize(layer.weight)))
                layer.register_forward_pre_hook(fp8_input)
        want = [hf(torch.tensor([p])).logits[0, -1] for p in prompts]
    for g, w in zip(got, want):
        assert float((g - w).norm() / w.norm()) < 1e-4


def test_an_fp8_checkpoint_and_the_same_weights_cast_at_load_give_the_same_tokens(model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    """A per-channel checkpoint holds what `quantization="fp8"` makes from the float weights:
    the two engines compute the same products, token for token."""
    _fp8_checkpoint(model_dir, tmp_path / "ct", "ct-channel")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(4, seed=2)
    cast = [o.outputs[0].token_ids for o in _llm(model_dir, quantization="fp8").generate(prompts, params)]
    loaded = [o.outputs[0].token_ids for o in _llm(tmp_path / "ct").generate(prompts, params)]
    assert cast == loaded


def test_unsupported_or_broken_quantized_checkpoints_are_refused_by_name(model_dir: Path, tmp_path: Path) -> None:
    base = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        ModelConfig.from_hf_dict({**base, "quantization_config": {"quant_method": "awq"}})
    int8 = {"quant_method": "compressed-tensors",
            "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}
    with pytest.raises(ValueError, match="8-bit float"):
        ModelConfig.from_hf_dict({**base, "quantization_config": int8})
    # A weight whose scale is missing.
    _fp8_checkpoint(model_dir, tmp_path / "broken", "fp8-tensor")
    tensors = load_file(str(tmp_path / "broken" / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "broken" / "model.safetensors"))
    with pytest.raises(ValueError, match="without scales"):
        _llm(tmp_path / "broken")
    with pytest.raises(ValueError, match="quantization"):
        _llm(model_dir, quantization="int4")


# -- the fp8 KV cache --------------------------------------------------------------------------------


def test_an_fp8_kv_cache_holds_twice_the_blocks_and_decodes_within_fp8_noise(model_dir: Path) -> None:
    budget = 1 << 20
    plain = LLM(str(model_dir), dtype="float16", max_model_len=256, kv_cache_memory=budget, progress=False)
    quant = LLM(str(model_dir), dtype="float16", max_model_len=256, kv_cache_memory=budget, kv_cache_dtype="fp8",
                progress=False)
    assert quant.engine.kv_caches[0][0].dtype is torch.float8_e4m3fn
    assert quant.engine.num_kv_blocks == 2 * plain.engine.num_kv_blocks
    prompts = _prompts(4, seed=3)
    for want, got in zip(_logits(plain, prompts), _logits(quant, prompts)):
        assert float((got - want).norm() / want.norm()) < 0.1
    out = quant.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_a_checkpoints_kv_scales_reach_the_attention_layers(model_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(model_dir, tmp_path / "m")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([4.0])
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    llm = _llm(tmp_path / "m", kv_cache_dtype="fp8")
    layers = llm.engine.model.model.layers
    assert layers[0].self_attn.kv_scales == (0.25, 1.0) and layers[1].self_attn.kv_scales == (1.0, 4.0)
    out = llm.generate(_prompts(1), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(-1.0)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="k_scale"):
        _llm(tmp_path / "m")


@pytest.mark.parametrize("names", [("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
                                   ("self_attn.kv_scale", None)], ids=["output-scale", "kv-scale"])
def test_kv_scales_in_an_fp8_checkpoints_other_layouts_reach_attention(model_dir: Path, tmp_path: Path,
                                                                      names: tuple[str, str | None]) -> None:
    """vLLM reads an fp8 checkpoint's calibrated KV scales from the K and V projections' output
    scales too (and, in older ones, one kv_scale for both): they were dropped as unused
    activation scales, and an fp8 KV cache ran at scale 1 with no word of it."""
    _fp8_checkpoint(model_dir, tmp_path / "m", "fp8-tensor")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    k_name, v_name = names
    tensors[f"model.layers.0.{k_name}"] = torch.tensor(4.0)
    if v_name is not None:
        tensors[f"model.layers.0.{v_name}"] = torch.tensor(0.5)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    llm = _llm(tmp_path / "m", kv_cache_dtype="fp8")
    layers = llm.engine.model.model.layers
    assert layers[0].self_attn.kv_scales == ((4.0, 0.5) if v_name is not None else (4.0, 4.0))
    assert layers[1].self_attn.kv_scales == (1.0, 1.0)


def test_pools_of_other_tensor_parallel_sizes_quantized_at_load_share_a_fingerprint(model_dir: Path) -> None:
    """`--quantization fp8 --prefill-tp 2 --decode-tp 1`: each rank quantizes its own shard, and a
    row-parallel shard's rows (o_proj, down_proj: half the columns) get other scales and bytes
    than the whole model's. Fingerprinted as they were, every KV hello between the pools was
    refused as another model's. The unquantized model is still another model."""
    from pdserve.kernels.backend_choice import AttentionBackend
    from pdserve.workers.model.loader import load_model
    from pdserve.workers.model.tensor_parallel import TensorParallel
    from pdserve.workers.transfer.fingerprint import module_fingerprint

    cfg = ModelConfig.from_pretrained(model_dir)

    def fingerprint(tp: TensorParallel, quantization: str | None) -> str:
        m = load_model(model_dir, cfg, torch.float32, torch.device("cpu"), AttentionBackend.TORCH, 256,
                       quantization=quantization, tp=tp)
        return module_fingerprint(str(model_dir), m)

    whole = fingerprint(TensorParallel(), "fp8")
    assert fingerprint(TensorParallel(2, 0), "fp8") == whole
    assert fingerprint(TensorParallel(), None) != whole
