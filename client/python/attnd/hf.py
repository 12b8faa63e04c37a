"""attnd.hf: runs a Hugging Face transformers model's attention in attnd.

The adapter registers an attention function (default name "attnd") with
transformers' AttentionInterface. Every attention layer of the model then sends
the NEW tokens' q, k and v (already rotated: transformers applies RoPE before it
calls the attention function) to attnd as one Step, one item per batch row (one
attnd session per row), and gets the attention output back. attnd holds the KV
cache; transformers' own cache holds nothing: pass ``past_key_values=adapter.cache()``
(an AttndCache, which only counts tokens) or run with ``use_cache=False``.

    import attnd, attnd.hf
    client = attnd.Client("/run/attnd/attnd.sock")   # daemon started with --rope none
    adapter = attnd.hf.AttndAdapter(client)            # and the model's shape, bf16
    adapter.attach(model)                              # checks the shape, switches attention
    with adapter.cache() as cache:                     # one attnd session per batch row
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=20)
    adapter.detach(model)                              # back to the previous attention

The daemon must run with ``--rope none`` and the model's layers, q/kv heads and
head_dim (bf16 or fp16 activations; any KV cache type), and with the model's
per-layer attention variants: ``attnd.model_shape_from_config(cfg, rope="none").flags()``
gives them all (``--attention-windows``, ``--softcap``, ``--attention-sinks``).
Supported: decoder models whose attention modules carry ``layer_idx`` and call
``past_key_values.update()`` (Llama, Mistral, Qwen2/3, Gemma 2/3, gpt-oss, ...):
whatever RoPE the model applies (YaRN, per-layer-type bases: transformers rotates q
and k before the attention function), q/k norms, per-layer sliding windows (the
daemon's own, checked against the model's), logit soft-capping and gpt-oss's sinks
(attach() uploads each layer's ``sinks`` with SetSinks: an operator connection),
causal, full (``is_causal=False``) and per-item sliding-window masks, greedy/sampled
generation, beam search and ``crop`` (sessions are forked and truncated in attnd).
Not supported: padded batches (rows of different lengths) and custom 4D masks; both
raise NotImplementedError rather than compute something else.

Token ids travel with every Step (attnd keys its prefix cache on them); the adapter
reads them from the model's ``input_ids`` through a forward pre-hook, or sends zeros
when the model is driven with ``inputs_embeds``.

This module imports torch and transformers only when the adapter is used. The
sessions-and-steps core (AttndRunner) takes numpy or torch tensors, so it is tested
without them. The adapter hands the client torch tensors in the daemon's activation
dtype (bf16 stays bf16, no numpy round trip, nothing walked in Python); with the
model on the daemon's GPU and a client whose ipc mode allows it (``attnd.Client(...,
ipc=True)``; "auto" does for large steps), each layer's q, k and v are copied into
staging tensors of that layer, registered once (RegisterBuffer), and the daemon
reads them and writes the output in place (same-host zero-copy): no tensor bytes
on the socket.
"""

import math
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from . import client as _client
from . import errors

DEFAULT_NAME = "attnd"
_LAST_ADAPTER = None  # the attention function's fallback when a module has no adapter attribute


# ---- the numpy core: sessions per batch row, plans, steps ----

class _Sequences:
    """The attnd sessions behind one batch of sequences: one session per row and
    the number of tokens each layer holds. An AttndCache owns one; the adapter
    owns one more for calls made without a cache (use_cache=False)."""

    def __init__(self, runner, prefix=False, salt=b""):
        self.runner = runner
        self.prefix = prefix  # open sessions with their prompt: attnd's prefix cache may hold it
        self.salt = salt
        self.sessions = []
        self.cached = []   # per row: leading positions attnd already holds for `prompts`
        self.opened_cached = []  # per row: cached_len as OpenSession answered
        self.prompts = []  # per row: the token ids a session was opened with
        self.len = {}      # layer -> tokens attnd holds for every row
        self.plan = None   # (plan id, key) of the current forward pass
        self.closed = False

    def ensure(self, rows, start, tokens=None):
        """Opens one session per row when the batch has none (or another size); with
        `prefix`, each with its row's tokens, so that attnd reports what it already holds."""
        if self.closed:
            raise RuntimeError("this AttndCache was closed; make a new one with adapter.cache()")
        if len(self.sessions) == rows:
            return
        if self.sessions and start != 0:
            raise ValueError(f"batch size changed from {len(self.sessions)} to {rows} in the middle of a "
                             f"sequence (position {start}); start a new cache")
        self.drop()
        c = self.runner.client
        if self.prefix and start == 0 and tokens is not None:
            opened = [c.open_session(t, salt=self.salt) for t in tokens]
            self.sessions = [sid for sid, _ in opened]
            self.cached = [n for _, n in opened]
            self.opened_cached = list(self.cached)
            self.prompts = [list(t) for t in tokens]
        else:
            self.sessions = [c.open_session()[0] for _ in range(rows)]
            self.cached = [0] * rows
            self.opened_cached = list(self.cached)
            self.prompts = [[] for _ in range(rows)]
        self.len = {}

    def held(self, r, start, tokens):
        """The first position of row r (from `start`, with these token ids) that attnd
        does not hold yet: past what the prefix cache gave, or past the first token
        that differs from the prompt the session was opened with."""
        c = self.cached[r] if r < len(self.cached) else 0
        if c <= start:
            return start
        want = self.prompts[r][start:c]
        return c if list(tokens[:len(want)]) == want else start

    def drop(self):
        """Closes the sessions (best effort: a restarted daemon has lost them anyway)."""
        self.runner.drain()
        for sid in self.sessions:
            try:
                self.runner.client.close_session(sid)
            except (errors.AttndError, OSError):
                pass
        self.sessions = []
        self.cached = []
        self.prompts = []
        self.len = {}
        self.plan = None

    def close(self):
        self.drop()
        self.closed = True

    def seq_length(self, layer=0):
        return self.len.get(layer, 0)

    def select(self, indices):
        """Keeps rows `indices` (repeats fork the session, unused rows are closed):
        beam search's reorder, num_return_sequences' repeat, contrastive's select."""
        indices = [int(i) for i in indices]
        if not self.sessions:
            return
        self.runner.drain()
        c = self.runner.client
        used, new = set(), []
        for i in indices:
            sid = self.sessions[i]
            new.append(c.fork(sid) if sid in used else sid)
            used.add(sid)
        for sid in self.sessions:
            if sid not in used:
                try:
                    c.close_session(sid)
                except errors.AttndError:
                    pass
        self.cached = [self.cached[i] for i in indices]
        self.prompts = [self.prompts[i] for i in indices]
        self.sessions = new
        self.plan = None

    def truncate(self, length):
        self.runner.drain()
        for sid in self.sessions:
            self.runner.client.truncate(sid, length)
        self.len = {layer: min(n, length) for layer, n in self.len.items()}
        self.cached = [min(c, length) for c in self.cached]
        self.plan = None


class AttndRunner:
    """Sends one layer's packed q, k, v for a batch of sequences to attnd.

    The first layer of a forward pass admits a Plan (the rows' items with their
    token ids and mask); every layer then steps with it, so the per-layer request
    carries only tensors. A plan that attnd ended meanwhile is replaced once.
    """

    def __init__(self, client: "_client.Client") -> None:
        self.client = client
        self.shape = client.health().model
        self.steps = 0
        self.plans = 0
        # (request id, layer) of steps sent with a done signal whose answers are
        # still to be read (step(done=...)): read at the next step or drain().
        self._inflight = []

    def drain(self) -> None:
        """Reads the answers of steps whose outputs were handed on at their done
        signal (step(done=...)). One that failed raises: its output was already used."""
        pend, self._inflight = self._inflight, []
        self._read(pend)

    def _read(self, pend) -> None:
        for i, (rid, layer) in enumerate(pend):
            try:
                self.client.step_recv(rid)
            except errors.AttndError as e:
                for r, _ in pend[i + 1:]:  # read the rest: nothing is left pending
                    try:
                        self.client.step_recv(r)
                    except errors.AttndError:
                        pass
                raise RuntimeError(f"attnd: layer {layer}'s step failed after its output was "
                                   f"handed on (AttndAdapter(overlap=True)): {e}; the forward pass "
                                   "that used it is wrong, run it again") from e

    def sequences(self, prefix: bool = False, salt: bytes = b"") -> "_Sequences":
        return _Sequences(self, prefix, salt)

    def step(self, seqs: "_Sequences", layer: int, q: Any, k: Any, v: Any,
             start: int, tokens: Sequence[Sequence[int]], mask: Optional["_client.Mask"] = None,
             fp32_out: bool = False, out: Any = None, done: Any = None) -> Any:
        """q [rows*n, q_heads, D], k and v [rows*n, kv_heads, D] (numpy or torch, rows in
        order), tokens: rows lists of n ids. Returns out [rows*n, q_heads, D] (numpy, or
        torch for torch inputs). out: for torch CUDA inputs sent by reference, the tensor
        the daemon writes (a reused staging tensor). done: for those, an
        attnd.ipc.DoneSignal of this layer's: the step is sent, the current stream waits
        for the signal on the device, and out is returned at once; the answer is read
        at the next step (or drain()), and a failure there raises.

        Rows whose leading positions attnd already holds (a prefix-cache hit of a
        sequences(prefix=True)) send only the rest; their held rows' outputs are zeros,
        which is right for generation (only the last position's logits count) and
        only for it."""
        rows = len(tokens)
        n = len(tokens[0])
        seqs.ensure(rows, start, tokens)
        end = start + n
        firsts = [seqs.held(r, start, tokens[r]) if mask is None else start for r in range(rows)]
        sel = None
        is_torch = _client._is_torch(q)
        if any(f > start for f in firsts):
            sel = np.concatenate([np.arange(r * n + f - start, (r + 1) * n) for r, f in enumerate(firsts)])
            if is_torch:
                sel = _torch().as_tensor(sel, device=q.device)
            q, k, v = q[sel], k[sel], v[sel]
            out = None  # fewer rows than the staging tensor's: the client allocates
        mask_key = None if mask is None else (mask.kind, mask.window, mask.prefix_len)
        key = (start, n, tuple(firsts), mask_key, tuple(tuple(t) for t in tokens))
        items = [_client.Item(sid, f, end - f, tokens=list(t[f - start:]), mask=mask)
                 for sid, t, f in zip(seqs.sessions, tokens, firsts)]
        if done is not None and not (is_torch and q.is_cuda):
            done = None
        if done is None or seqs.plan is None or seqs.plan[1] != key:
            self.drain()  # a plan made now must not end a step still unanswered
        res = None
        for attempt in (0, 1):
            if seqs.plan is None or seqs.plan[1] != key:
                seqs.plan = (self.client.plan(items), key)
                self.plans += 1
            if done is not None:
                rid = self.client.step_send(layer, q, k, v, plan=seqs.plan[0], fp32_out=fp32_out,
                                            out=out, done=done)
                prev, self._inflight = self._inflight, [(rid, layer)]
                done.wait()
                out_t = self.client._ipc_out[rid][0]
                self._read(prev)  # the earlier layers' answers, there by now
                break
            try:
                res = self.client.step(layer, q, k, v, plan=seqs.plan[0], fp32_out=fp32_out,
                                       out=out)
                break
            except errors.FailedPrecondition:
                # The plan ended (too many live plans on this connection, or a
                # Fork/Truncate touched a session): admit a fresh one, once.
                seqs.plan = None
                if attempt:
                    raise
        seqs.len[layer] = end
        for r, f in enumerate(firsts):  # what this step rewrote is no longer the prompt's
            if r < len(seqs.cached) and f < seqs.cached[r]:
                seqs.cached[r] = f
        self.steps += 1
        out = res.out if res is not None else out_t
        if sel is not None:
            if is_torch:
                full = _torch().zeros((rows * n,) + tuple(out.shape[1:]), dtype=out.dtype,
                                      device=out.device)
                full[sel.to(out.device)] = out
            else:
                full = np.zeros((rows * n,) + out.shape[1:], dtype=out.dtype)
                full[sel] = out
            out = full
        return out


# ---- torch side ----

def _torch():
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise ImportError("attnd.hf needs PyTorch and transformers (pip install torch transformers)") from e
    return torch


def _act(t, dtype):
    """A torch tensor in the daemon's activation dtype, contiguous, on its device: the
    client sends it as it is (or by reference), with no numpy round trip."""
    torch = _torch()
    return t.detach().to(torch.float16 if dtype == "fp16" else torch.bfloat16).contiguous()


def _from_wire(a, like):
    """A step output (torch, or numpy: bf16 bits / ml_dtypes bf16, fp16 or fp32) -> torch,
    like `like`."""
    torch = _torch()
    if _client._is_torch(a):
        return a.to(device=like.device, dtype=like.dtype)
    # A large output is a writable view of the received frame (the client's
    # _frames.py): used as it is. A small one views protobuf's read-only bytes,
    # and torch wants a writable array: copied.
    if not a.flags.writeable:
        a = np.array(a)
    if a.dtype == np.float32 or a.dtype == np.float16:
        t = torch.from_numpy(a)
    else:  # bf16 bits (uint16) or ml_dtypes.bfloat16: both 2 bytes
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return t.to(device=like.device, dtype=like.dtype)


def _set_attn_implementation(model, name):
    """Switches a model's attention function (transformers 4.4x .. 5.x)."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
        except Exception:  # older releases validate only built-in names; set it directly below
            pass
    if getattr(model.config, "_attn_implementation", None) != name:
        model.config._attn_implementation = name
    if getattr(model.config, "_attn_implementation", None) != name:
        raise RuntimeError(f"could not switch the model's attention to {name!r}")


def register(name: str = DEFAULT_NAME) -> None:
    """Registers attnd_attention_forward under `name` with transformers' attention registry."""
    try:
        from transformers import AttentionInterface
        AttentionInterface.register(name, attnd_attention_forward)
    except ImportError:  # 4.48/4.49: a plain dict
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError as e:
            raise ImportError("attnd.hf needs transformers >= 4.48 (models that call their attention "
                              "through ALL_ATTENTION_FUNCTIONS)") from e
        ALL_ATTENTION_FUNCTIONS[name] = attnd_attention_forward


def attnd_attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                            dropout: float = 0.0, scaling: Optional[float] = None,
                            is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                            **kwargs: Any) -> Any:
    """transformers' attention-function signature: query [b, q_heads, n, D], key and
    value [b, kv_heads, n, D] (rotated, new tokens only); returns ([b, n, q_heads, D], None)."""
    adapter = getattr(module, "_attnd_adapter", None) or _LAST_ADAPTER
    if adapter is None:
        raise RuntimeError("attnd attention called on a model without an adapter: "
                           "call attnd.hf.AttndAdapter(client).attach(model) first")
    return adapter.attention(module, query, key, value, attention_mask, dropout=dropout,
                             scaling=scaling, is_causal=is_causal, sliding_window=sliding_window,
                             **kwargs)


class AttndAdapter:
    """Runs the attention of the models attached to it in one attnd daemon.

    client: an attnd.Client. name: the attention implementation's name.
    fp32_out: ask attnd for fp32 outputs (default: when the model computes in fp32).
    overlap: for steps by reference, hand each layer's output on as soon as the
    daemon's kernels have written it (a done signal per layer that the model's
    stream waits for on the device, docs/protocol.md §5a) and read the step's answer
    during the next layer's: the model's own work no longer waits for the answer
    (bench/bench_done.py: 1.4x per token in a decode loop). The price: a step that
    fails after its output was handed on (a plan that ended meanwhile, a device
    error) fails the forward pass (RuntimeError) instead of being retried.
    """

    def __init__(self, client: "_client.Client", name: str = DEFAULT_NAME,
                 fp32_out: Optional[bool] = None, overlap: bool = False) -> None:
        self.client = client
        self.name = name
        self.fp32_out = fp32_out
        self.overlap = overlap
        self._done = {}  # layer -> attnd.ipc.DoneSignal (overlap)
        self.runner = AttndRunner(client)
        self.shape = self.runner.shape
        self._nocache = self.runner.sequences()
        self._pending = {}   # layer -> (sequences, start, cache): set by AttndCache.update
        self._tokens = None  # [b, n] input ids of the current forward (CPU), or None
        self._caches = weakref.WeakSet()
        self._hooks = {}
        self._prev = {}
        self._scale_ok = set()
        self._sinks = {}  # layer -> (data_ptr, version) of the sinks last uploaded
        # layer -> (q, k, v, out) staging tensors on the daemon's device, for steps by
        # reference (same-host zero-copy): registered once, reused every forward.
        self._staging = {}
        register(name)

    # -- models --

    def check_model(self, model: Any) -> None:
        """Raises ValueError when the daemon's shape does not fit the model's config."""
        cfg = model.config
        if hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()
        s = self.shape
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        want = dict(layers=cfg.num_hidden_layers, q_heads=heads, kv_heads=kv, head_dim=hd, rope="none")
        have = dict(layers=s.layers, q_heads=s.q_heads, kv_heads=s.kv_heads, head_dim=s.head_dim, rope=s.rope)
        # The per-layer variants, as the daemon derives them from the same config.
        from .model_config import model_shape_from_config
        ms = model_shape_from_config(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg, rope="none")
        want.update(windows=[ms.window(l) for l in range(ms.layers)], softcap=float(ms.softcap),
                    sinks=bool(ms.attention_sinks))
        have.update(windows=[self._window(l) for l in range(ms.layers)],
                    softcap=float(getattr(s, "softcap", 0.0) or 0.0),
                    sinks=bool(getattr(s, "attention_sinks", False)))
        bad = [f"{k} {have[k]} (model: {want[k]})" for k in want
               if (abs(want[k] - have[k]) > 1e-6 * abs(want[k]) if k == "softcap" else want[k] != have[k])]
        if s.dtype not in ("bf16", "fp16"):
            bad.append(f"dtype {s.dtype}")
        if bad:
            raise ValueError("attnd's shape does not fit the model: " + ", ".join(bad) +
                             "; start attnd with attnd.model_shape_from_config(config, rope='none')"
                             ".flags() (--rope none: transformers rotates q and k itself)")

    def _window(self, layer):
        """The daemon's window of a layer (0: full), from Health."""
        wins = [int(w) for w in (getattr(self.shape, "attention_windows", "") or "").split(",") if w]
        return wins[layer % len(wins)] if wins else 0

    def upload_sinks(self, model: Any) -> int:
        """SetSinks for every attention module with a ``sinks`` parameter (gpt-oss) whose
        values changed since the last upload; returns how many layers were sent."""
        sent = 0
        for m in model.modules():
            layer, sk = getattr(m, "layer_idx", None), getattr(m, "sinks", None)
            if layer is None or sk is None or not hasattr(sk, "detach"):
                continue
            if self._upload_sink(layer, sk):
                sent += 1
        return sent

    def _upload_sink(self, layer, sk):
        tag = (sk.data_ptr(), getattr(sk, "_version", 0))
        if self._sinks.get(layer) == tag:
            return False
        self.client.set_sinks(layer, sk.detach().float().cpu().numpy().reshape(-1))
        self._sinks[layer] = tag
        return True

    def attach(self, model: Any, set_implementation: bool = True) -> Any:
        """Checks the shape, points the model's attention modules at this adapter,
        hooks the forward to learn token ids, and switches the attention to attnd."""
        global _LAST_ADAPTER
        self.check_model(model)
        for m in model.modules():
            if hasattr(m, "layer_idx"):
                m._attnd_adapter = self
        if id(model) not in self._hooks:
            self._hooks[id(model)] = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        if set_implementation:
            self._prev[id(model)] = getattr(model.config, "_attn_implementation", None) or "sdpa"
            _set_attn_implementation(model, self.name)
        if getattr(self.shape, "attention_sinks", False):
            self.upload_sinks(model)
        _LAST_ADAPTER = self
        return model

    def detach(self, model: Any, implementation: Optional[str] = None) -> None:
        """Undoes attach(): back to `implementation` (default: the one attach replaced)."""
        global _LAST_ADAPTER
        h = self._hooks.pop(id(model), None)
        if h is not None:
            h.remove()
        for m in model.modules():
            if getattr(m, "_attnd_adapter", None) is self:
                del m._attnd_adapter
        prev = implementation or self._prev.pop(id(model), "sdpa")
        _set_attn_implementation(model, prev)
        if _LAST_ADAPTER is self:
            _LAST_ADAPTER = None

    def cache(self, prefix: bool = False, salt: bytes = b"") -> Any:
        """A new AttndCache: pass it as past_key_values; close it (or use `with`) when done.

        prefix=True opens each row's session with its prompt, so attnd's prefix cache
        may already hold its leading blocks (sessions with equal `salt` share); those
        positions are not sent again and their outputs are zeros: the logits of the
        prompt's cached positions are then meaningless, the last one's are exact.
        For generation, not for scoring a prompt's every position."""
        c = _cache_class()(self, prefix, salt)
        self._caches.add(c)
        return c

    def close(self) -> None:
        """Closes every session this adapter opened."""
        self.runner.drain()
        for c in list(self._caches):
            c.close()
        self._nocache.drop()

    def _pre_hook(self, module, args, kwargs):
        torch = _torch()
        ids = kwargs.get("input_ids")
        if ids is None and args and torch.is_tensor(args[0]) and not args[0].is_floating_point():
            ids = args[0]
        self._tokens = ids.detach().to("cpu") if ids is not None else None
        am = kwargs.get("attention_mask")
        if am is None and len(args) > 1 and torch.is_tensor(args[1]):
            am = args[1]
        if torch.is_tensor(am) and am.dim() == 2 and not bool(am.bool().all()):
            raise NotImplementedError("attnd.hf does not handle padded batches (attention_mask has zeros): "
                                      "run rows of different lengths as separate batches")
        return None

    # -- the attention call --

    def _row_tokens(self, b, n):
        t = self._tokens
        if t is not None and t.dim() == 2 and t.shape[0] == b and t.shape[1] >= n:
            return t[:, t.shape[1] - n:].tolist()
        return [[0] * n for _ in range(b)]

    def _check_scale(self, scaling):
        if scaling is None or scaling in self._scale_ok:
            return
        ds = self.shape.softmax_scale or 1.0 / math.sqrt(self.shape.head_dim)
        if abs(float(scaling) - ds) > 1e-6 * ds:
            raise ValueError(f"the model scales attention by {scaling}, attnd by {ds}: "
                             f"start attnd with --softmax-scale {scaling}")
        self._scale_ok.add(scaling)

    @staticmethod
    def _check_mask(attention_mask, start, n, window=0):
        """Accepts a 4D mask only when it is the plain causal one (what attnd applies),
        intersected with the layer's window when it slides."""
        torch = _torch()
        if not torch.is_tensor(attention_mask) or attention_mask.dim() != 4:
            raise NotImplementedError(f"attnd.hf cannot apply a {type(attention_mask).__name__} mask")
        kv = start + n
        if attention_mask.shape[-1] < kv or attention_mask.shape[-2] != n:
            raise NotImplementedError(f"attention mask of shape {tuple(attention_mask.shape)} for "
                                      f"{n} queries at position {start}")
        m = attention_mask[..., :kv]
        vis = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        p = torch.arange(start, kv, device=m.device)[:, None]
        j = torch.arange(kv, device=m.device)[None, :]
        want = (j <= p) & (j > p - window) if window else j <= p
        if not torch.equal(vis, want.expand_as(vis)):
            raise NotImplementedError("attnd.hf applies causal masks only; this attention mask differs "
                                      "(padding or a custom pattern)")

    def attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  is_causal=None, sliding_window=None, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise RuntimeError(f"{type(module).__name__} has no layer_idx; attnd needs it")
        b, hq, n, d = query.shape
        pend = self._pending.pop(layer, None)
        if pend is not None:
            seqs, start, cache = pend
        else:
            seqs, cache = self._nocache, None
            cp = kwargs.get("cache_position")
            start = int(cp.reshape(-1)[0]) if cp is not None else 0
        try:
            out = self._step(module, layer, seqs, start, query, key, value, attention_mask, dropout,
                             scaling, is_causal, sliding_window, kwargs)
        except BaseException:
            if cache is not None:  # the cache counted tokens attnd did not take
                cache._len[layer] = start
            raise
        return _from_wire(out, query).reshape(b, n, hq, d), None

    def _check_variants(self, module, layer, kwargs):
        """Soft-capping and sinks as the model passes them (Gemma 2's softcap, gpt-oss's
        s_aux) against what the daemon computes."""
        cap = kwargs.get("softcap")
        dcap = float(getattr(self.shape, "softcap", 0.0) or 0.0)
        if abs(float(cap or 0.0) - dcap) > 1e-6 * max(dcap, 1.0):
            raise ValueError(f"layer {layer}: the model soft-caps at {cap}, attnd at {dcap}: "
                             f"start attnd with --softcap {cap or 0}")
        s_aux = kwargs.get("s_aux")
        if s_aux is None:
            s_aux = kwargs.get("sinks")
        dsinks = bool(getattr(self.shape, "attention_sinks", False))
        if (s_aux is not None) != dsinks:
            raise ValueError(f"layer {layer}: the model has {'' if s_aux is not None else 'no '}attention "
                             f"sinks, attnd {'has' if dsinks else 'has none'} (--attention-sinks)")
        if s_aux is not None:
            self._upload_sink(layer, s_aux)  # a no-op unless the values changed

    def _step(self, module, layer, seqs, start, query, key, value, attention_mask, dropout, scaling,
              is_causal, sliding_window, kwargs):
        b, hq, n, d = query.shape
        hkv = key.shape[1]
        if key.shape[2] != n:
            raise RuntimeError(f"layer {layer}: {key.shape[2]} keys for {n} queries: the model's own KV "
                               "cache holds history; pass past_key_values=adapter.cache() or use_cache=False")
        if dropout and module.training:
            raise NotImplementedError("attnd.hf runs inference only (attention dropout in training mode)")
        self._check_scale(scaling)
        self._check_variants(module, layer, kwargs)
        # A sliding layer whose window the daemon applies itself needs no mask; one
        # it does not (an older daemon, or a window only the model has) gets the
        # per-item sliding mask.
        dwin = self._window(layer)
        if sliding_window and dwin and int(sliding_window) != dwin:
            raise ValueError(f"layer {layer}: the model slides by {sliding_window}, attnd by {dwin}")
        if not sliding_window and dwin:
            raise ValueError(f"layer {layer}: attnd slides by {dwin}, the model's layer is full")
        if attention_mask is not None:
            self._check_mask(attention_mask, start, n, int(sliding_window or 0))
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = None
        if not causal:
            mask = _client.Mask.full()
        elif sliding_window and not dwin:
            mask = _client.Mask.sliding_window(int(sliding_window))
        tokens = self._row_tokens(b, n)
        dt = self.shape.dtype
        fp32 = self.fp32_out if self.fp32_out is not None else query.dtype == _torch().float32
        staged = self._stage(layer, query, key, value, fp32) if query.is_cuda else None
        done = None
        if staged is not None:
            q, k, v, out = staged
            if self.overlap:
                done = self._done.get(layer)
                if done is None or done.tensor.device != query.device:
                    from . import ipc as _ipc

                    done = self._done[layer] = _ipc.DoneSignal(self.client, query.device)
        else:
            q = _act(query.transpose(1, 2).reshape(b * n, hq, d), dt)
            k = _act(key.transpose(1, 2).reshape(b * n, hkv, d), dt)
            v = _act(value.transpose(1, 2).reshape(b * n, hkv, d), dt)
            out = None
        return self.runner.step(seqs, layer, q, k, v, start, tokens, mask, fp32_out=fp32, out=out,
                                done=done)

    def _stage(self, layer, query, key, value, fp32):
        """Same-host zero-copy: the layer's q, k and v copied (one kernel each, the
        transpose and the cast included) into its staging tensors, and the staging
        output the daemon writes, as (q, k, v, out) views of rows*n rows; None when
        the client sends this step as bytes."""
        torch = _torch()
        c = self.client
        b, hq, n, d = query.shape
        hkv = key.shape[1]
        rows = b * n
        act = torch.float16 if self.shape.dtype == "fp16" else torch.bfloat16
        odt = torch.float32 if fp32 else act
        if not c.ipc.would_use(query.device, 2 * rows * (hq + 2 * hkv) * d):
            return None
        st = self._staging.get(layer)
        if st is None or st[0].shape[0] < rows or st[0].device != query.device or st[3].dtype != odt:
            dev = query.device
            new = (torch.empty((rows, hq, d), dtype=act, device=dev),
                   torch.empty((rows, hkv, d), dtype=act, device=dev),
                   torch.empty((rows, hkv, d), dtype=act, device=dev),
                   torch.empty((rows, hq, d), dtype=odt, device=dev))
            if not c.ipc.usable(*new[:3]):
                return None
            for t in st or ():
                c.ipc.unkeep(t)
            for t in new:
                c.ipc.keep(t)
            self._staging[layer] = st = new
        elif not c.ipc.usable(st[0][:rows], st[1][:rows], st[2][:rows]):
            return None
        q, k, v, out = (t[:rows] for t in st)
        q.view(b, n, hq, d).copy_(query.transpose(1, 2))
        k.view(b, n, hkv, d).copy_(key.transpose(1, 2))
        v.view(b, n, hkv, d).copy_(value.transpose(1, 2))
        return q, k, v, out


# ---- transformers' Cache, holding nothing but counts ----

_CACHE_CLS = None


def _cache_class():
    """AttndCache, defined on first use so that importing attnd.hf needs no transformers."""
    global _CACHE_CLS
    if _CACHE_CLS is not None:
        return _CACHE_CLS
    from transformers.cache_utils import DynamicCache

    class AttndCache(DynamicCache):
        """A transformers Cache whose KV lives in attnd: update() stores nothing, it
        counts each layer's tokens and tells the adapter where the new ones start, and
        returns them unchanged, so the attention function gets only the new k and v.
        Closing it (or leaving a `with`) closes its attnd sessions."""

        def __init__(self, adapter, prefix=False, salt=b""):
            DynamicCache.__init__(self)
            self._adapter = adapter
            self._seqs = adapter.runner.sequences(prefix, salt)
            self._len = {}

        # what the models call
        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            if self._adapter._pending.get(layer_idx, (None,))[0] is self._seqs:
                # The last update of this layer never reached attnd: the model's
                # attention is not attnd's, and it just attended to the new tokens only.
                raise RuntimeError("an AttndCache needs the model's attention set to attnd "
                                   "(adapter.attach(model))")
            start = self._len.get(layer_idx, 0)
            self._len[layer_idx] = start + key_states.shape[-2]
            self._adapter._pending[layer_idx] = (self._seqs, start, self)
            return key_states, value_states

        def get_seq_length(self, layer_idx=0):
            return self._len.get(layer_idx or 0, 0)

        def get_usable_length(self, new_seq_length=0, layer_idx=0):  # transformers 4.3x/4.4x
            return self.get_seq_length(layer_idx)

        def get_mask_sizes(self, cache_position, layer_idx=0):
            # Releases pass the new positions (a tensor) or, later, just their number.
            q = cache_position if isinstance(cache_position, int) else cache_position.shape[0]
            return self.get_seq_length(layer_idx) + q, 0

        def get_max_length(self):  # transformers 4.4x
            return None

        # what generation strategies call
        def crop(self, max_length):
            cur = self.get_seq_length()
            if max_length < 0:
                max_length = cur + max_length
            if cur <= max_length:
                return
            self._seqs.truncate(max_length)
            self._len = {layer: min(n, max_length) for layer, n in self._len.items()}

        def reorder_cache(self, beam_idx):
            self._seqs.select(beam_idx.tolist())

        def batch_select_indices(self, indices):
            if getattr(indices, "dtype", None) is not None and str(indices.dtype) == "torch.bool":
                indices = indices.nonzero().flatten()
            self._seqs.select(indices.tolist() if hasattr(indices, "tolist") else indices)

        def batch_repeat_interleave(self, repeats):
            rows = len(self._seqs.sessions)
            self._seqs.select([i for i in range(rows) for _ in range(repeats)])

        def reset(self):
            self._seqs.drop()
            self._len = {}

        def to_legacy_cache(self):
            raise NotImplementedError("an AttndCache holds no tensors: attnd keeps the KV")

        # its own
        @property
        def sessions(self):
            """The attnd session ids, one per batch row."""
            return list(self._seqs.sessions)

        @property
        def cached_len(self):
            """Per row: the prompt positions attnd's prefix cache held when the session opened."""
            return list(self._seqs.opened_cached)

        def close(self):
            self._seqs.close()
            self._len = {}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    _CACHE_CLS = AttndCache
    return AttndCache


def __getattr__(name: str) -> Any:  # attnd.hf.AttndCache, resolved lazily
    if name == "AttndCache":
        return _cache_class()
    raise AttributeError(name)
