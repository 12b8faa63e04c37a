"""The attnd model shape of a Hugging Face model, as `attnd --model-config` derives it.

    import attnd
    shape = attnd.model_shape_from_config("path/to/config.json")   # or a dict, a
    print(shape.flags())              # directory, or a transformers PretrainedConfig
    # ['--layers', '32', '--q-heads', '32', '--kv-heads', '8', '--head-dim', '128', ...]

The rules are the daemon's (docs/operations.md, "Model config"): the same fields are
read, the same defaults apply (per-layer sliding windows, soft-capping and gpt-oss's
sinks included), and a model whose attention attnd does not compute (scaled or
per-layer-type RoPE unless rope="none", latent or ALiBi attention) raises
attnd.UnsupportedModel naming the field, where the daemon refuses to start.
tests/e2e/test_model_config.py checks the two against each other.
"""
import json
import math
import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

__all__ = ["ModelShape", "UnsupportedModel", "model_shape_from_config"]

# Rotary layouts other than neox's rotate-half, and families with learned
# absolute positions (no RoPE in attention), by model_type.
_INTERLEAVED = ("gptj", "codegen")
_LEARNED = ("gpt2", "gpt_bigcode", "gpt_neo", "opt")
_ALIBI = ("bloom", "mpt")
HEAD_DIMS = (64, 128, 256)
MAX_WINDOWS = 256  # the daemon's most --attention-windows entries


class UnsupportedModel(ValueError):
    """The config describes attention attnd does not compute; .field names the key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ModelShape:
    """What attnd needs to know of a model's attention (attnd's option names in flags())."""
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rope: str = "neox"               # "neox", "interleaved" or "none"
    rope_theta: float = 10000.0
    rotary_dim: int = 0              # 0: head_dim
    softmax_scale: Optional[float] = None  # None: 1/sqrt(head_dim)
    max_context: Optional[int] = None
    dtype: Optional[str] = None      # "bf16", "fp16" or None (the daemon's default)
    model_id: Optional[str] = None   # the config's model_type
    layer_windows: Tuple[int, ...] = ()  # repeated over the layers; 0 full; (): all full
    softcap: float = 0.0             # attention logit soft-capping; 0: none
    attention_sinks: bool = False    # gpt-oss sinks (set with Client.set_sinks)

    def window(self, layer: int) -> int:
        """The sliding window of a layer (0: a full layer)."""
        return self.layer_windows[layer % len(self.layer_windows)] if self.layer_windows else 0

    def flags(self) -> List[str]:
        """The attnd command-line flags for this shape."""
        f = ["--layers", str(self.layers), "--q-heads", str(self.q_heads), "--kv-heads",
             str(self.kv_heads), "--head-dim", str(self.head_dim), "--rope", self.rope,
             "--rope-theta", repr(float(self.rope_theta)),
             "--rotary-dim", str(self.rotary_dim or self.head_dim)]
        if self.softmax_scale is not None:
            f += ["--softmax-scale", repr(float(self.softmax_scale))]
        if self.max_context is not None:
            f += ["--max-context", str(self.max_context)]
        if self.dtype is not None:
            f += ["--dtype", self.dtype]
        if self.model_id:
            f += ["--model-id", self.model_id]
        if self.layer_windows:
            f += ["--attention-windows", ",".join(map(str, self.layer_windows))]
        if self.softcap:
            f += ["--softcap", repr(float(self.softcap))]
        if self.attention_sinks:
            f += ["--attention-sinks", "true"]
        return f

    def mismatches(self, model: Any) -> List[str]:
        """How a daemon's Health().model differs from this shape ([] when it serves it)."""
        want = dict(layers=self.layers, q_heads=self.q_heads, kv_heads=self.kv_heads,
                    head_dim=self.head_dim, rope=self.rope)
        return [f"{k} {getattr(model, k)} (model: {v})" for k, v in want.items()
                if getattr(model, k) != v]


def _load(cfg: Any) -> Mapping[str, Any]:
    if isinstance(cfg, Mapping):
        return cfg
    if isinstance(cfg, (str, bytes, os.PathLike)):
        path = os.fsdecode(cfg)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return json.load(f)
    if hasattr(cfg, "to_dict"):  # transformers.PretrainedConfig
        return cfg.to_dict()
    raise TypeError(f"expected a config dict, a config.json path or a PretrainedConfig, not {type(cfg)!r}")


def _get(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        v = d.get(k)
        if v is not None:
            return v
    return None


def _int(d: Mapping[str, Any], *keys: str) -> Optional[int]:
    v = _get(d, *keys)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UnsupportedModel(next(k for k in keys if d.get(k) is not None),
                               "expected a non-negative integer")
    return v


def _given(d: Mapping[str, Any], key: str) -> bool:
    v = d.get(key)
    return v is not None and v is not False and v != 0


def _rope_params(rs: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(rs, Mapping):
        raise UnsupportedModel(field, "expected an object")
    kind = rs.get("rope_type", rs.get("type"))
    if kind is None and "rope_theta" not in rs:
        for k, v in rs.items():
            if isinstance(v, Mapping):
                raise UnsupportedModel(f"{field}.{k}", "RoPE parameters per layer type are not supported")
    if kind is not None and kind != "default":
        key = "rope_type" if "rope_type" in rs else "type"
        raise UnsupportedModel(f"{field}.{key}", f"'{kind}': attnd's RoPE is the default (unscaled) "
                               "rotation only")
    if rs.get("mrope_section") is not None:
        raise UnsupportedModel(f"{field}.mrope_section", "multimodal (3D) RoPE is not supported")
    return rs


def model_shape_from_config(cfg: Any, rope: Optional[str] = None) -> ModelShape:
    """The attnd shape of a Hugging Face model config.

    cfg: a config.json's dict, its path (or the model directory), or a transformers
    PretrainedConfig. rope: None to derive it from the model (attnd applies RoPE), or
    "none" when the client rotates q and k itself (attnd.hf): the RoPE fields are then
    neither used nor checked. Raises attnd.UnsupportedModel where `attnd --model-config`
    refuses the config."""
    root = _load(cfg)
    d = root
    if isinstance(root.get("text_config"), Mapping) and root.get("num_hidden_layers") is None:
        d = root["text_config"]  # a multimodal model: its language model
    layers = _int(d, "num_hidden_layers", "n_layer", "num_layers")
    if layers is None:
        raise UnsupportedModel("num_hidden_layers", "missing: not a transformers model config")
    heads = _int(d, "num_attention_heads", "n_head")
    if not heads:
        raise UnsupportedModel("num_attention_heads", "missing or 0")
    kv = _int(d, "num_key_value_heads", "num_kv_heads")
    if kv is None:
        kv = 1 if _given(d, "multi_query") else heads
    hd = _int(d, "head_dim")
    if hd is None:
        hidden = _int(d, "hidden_size", "n_embd")
        if not hidden:
            raise UnsupportedModel("head_dim", "neither head_dim nor hidden_size is given")
        if hidden % heads:
            raise UnsupportedModel("hidden_size", f"{hidden} is not a multiple of num_attention_heads {heads}")
        hd = hidden // heads
    max_pos = _int(d, "max_position_embeddings", "n_positions") or None
    dt = _get(d, "dtype", "torch_dtype")
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(dt) if isinstance(dt, str) else None
    mt = d.get("model_type") or root.get("model_type") or None

    # RoPE
    theta = 10000.0
    frac = 0.0
    rdim_abs = 0
    kind = "interleaved" if mt in _INTERLEAVED else "none" if mt in _LEARNED else "neox"
    if rope == "none":
        kind = "none"
    else:
        for k in ("rope_theta", "rotary_emb_base"):
            if d.get(k) is not None:
                theta = float(d[k])
        for k in ("partial_rotary_factor", "rotary_pct"):
            if d.get(k) is not None:
                frac = float(d[k])
        rdim_abs = _int(d, "rotary_dim") or 0
        for field in ("rope_scaling", "rope_parameters"):
            if d.get(field) is not None:
                rs = _rope_params(d[field], field)
                if rs.get("rope_theta") is not None:
                    theta = float(rs["rope_theta"])
                if rs.get("partial_rotary_factor") is not None:
                    frac = float(rs["partial_rotary_factor"])
        if not theta > 0:
            raise UnsupportedModel("rope_theta", f"{theta}: must be > 0")
        if frac and not 0 < frac <= 1:
            raise UnsupportedModel("partial_rotary_factor", f"{frac}: must be in (0, 1]")

        local = d.get("rope_local_base_freq")
        if local is not None and float(local) != theta:
            raise UnsupportedModel("rope_local_base_freq", f"{local}: sliding layers use another RoPE "
                                   f"base than rope_theta {theta}; use rope='none' and rotate in the client")

    # Per-layer windows, soft-capping, sinks (docs/numerics.md).
    windows = _layer_windows(d, layers, mt)
    softcap = float(d["attn_logit_softcapping"]) if d.get("attn_logit_softcapping") is not None else 0.0
    if softcap < 0:
        raise UnsupportedModel("attn_logit_softcapping", f"{softcap}: must be >= 0")
    sinks = mt == "gpt_oss" or _given(d, "attention_sinks")
    if _given(d, "kv_lora_rank"):
        raise UnsupportedModel("kv_lora_rank", "multi-head latent attention (MLA) is not supported")
    if _given(d, "alibi") or mt in _ALIBI:
        raise UnsupportedModel("alibi" if _given(d, "alibi") else "model_type",
                               "ALiBi position biases are not supported")
    scale = None
    if d.get("query_pre_attn_scalar") is not None:
        q = float(d["query_pre_attn_scalar"])
        if not q > 0:
            raise UnsupportedModel("query_pre_attn_scalar", f"{q}: must be > 0")
        scale = 1.0 / math.sqrt(q)
    if d.get("attention_multiplier") is not None:
        scale = float(d["attention_multiplier"])
        if not scale > 0:
            raise UnsupportedModel("attention_multiplier", f"{scale}: must be > 0")

    # What the daemon's own checks refuse.
    if hd not in HEAD_DIMS:
        raise UnsupportedModel("head_dim", f"{hd}: attnd serves head dims {', '.join(map(str, HEAD_DIMS))}")
    if kv == 0 or heads % kv:
        raise UnsupportedModel("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    rdim = hd
    if frac:
        r = frac * hd
        if abs(r - round(r)) > 1e-6 or round(r) % 2:
            raise UnsupportedModel("partial_rotary_factor", f"{frac} of head_dim {hd} is {r} dims, "
                                   "not a whole even number")
        rdim = int(round(r))
    elif rdim_abs:
        rdim = rdim_abs
    if rdim > hd or rdim % 2:
        raise UnsupportedModel("rotary_dim", f"{rdim}: must be even and <= head_dim {hd}")
    return ModelShape(layers=layers, q_heads=heads, kv_heads=kv, head_dim=hd, rope=kind,
                      rope_theta=theta, rotary_dim=rdim, softmax_scale=scale, max_context=max_pos,
                      dtype=dtype, model_id=mt, layer_windows=windows, softcap=softcap,
                      attention_sinks=sinks)


def _layer_windows(d: Mapping[str, Any], layers: int, mt: Optional[str]) -> Tuple[int, ...]:
    """Every layer's window as the daemon derives it, as its shortest period."""
    off = d.get("use_sliding_window") is False
    w = _int(d, "sliding_window") or 0
    pattern = _int(d, "sliding_window_pattern") or 0
    mwl = _int(d, "max_window_layers")
    if off:
        w = 0
    lt = d.get("layer_types")
    if lt is not None:
        if not isinstance(lt, (list, tuple)) or len(lt) != layers:
            raise UnsupportedModel("layer_types", f"expected an array of {layers} (num_hidden_layers) layer types")
        per = []
        for i, t in enumerate(lt):
            if t == "sliding_attention":
                if not w and not off:
                    raise UnsupportedModel(f"layer_types[{i}]", "sliding_attention without a sliding_window")
                per.append(w)
            elif t == "full_attention":
                per.append(0)
            else:
                raise UnsupportedModel(f"layer_types[{i}]", f"'{t}': only full_attention and "
                                       "sliding_attention layers are supported")
    elif w:
        if not pattern and mt in ("gemma3", "gemma3_text"):
            pattern = 6
        if not pattern and mt == "gemma2":
            pattern = 2
        per = [w if (((i + 1) % pattern != 0) if pattern else (i >= mwl if mwl is not None else True))
               else 0 for i in range(layers)]
    else:
        return ()
    if not any(per):
        return ()
    for p in range(1, layers + 1):
        if all(per[i] == per[i % p] for i in range(layers)):
            break
    if p > MAX_WINDOWS:
        raise UnsupportedModel("layer_types", f"the layers' windows repeat only every {p} layers")
    return tuple(per[:p])
