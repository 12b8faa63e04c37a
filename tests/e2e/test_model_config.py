"""--model-config: the shape attnd derives from a Hugging Face config.json, the
configs it refuses (naming the field), the precedence of flags and config keys
over it, and attnd.model_shape_from_config deriving the same from the same files
(model_configs/: configs shaped like those of real checkpoints, trimmed to the
fields that matter)."""
import glob
import json
import os
import re
import subprocess
import tempfile
import unittest

import attnd
from harness import Daemon, daemon_binary

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = sorted(glob.glob(os.path.join(HERE, "model_configs", "*.json")))

# What each file must give: the shape, or the field named in the refusal.
EXPECT = {
    "llama3_8b": dict(layers=32, q_heads=32, kv_heads=8, head_dim=128, rope="neox",
                      rope_theta=500000.0, rotary_dim=128, max_context=8192, dtype="bf16", model_id="llama"),
    "llama31_8b": "rope_scaling.rope_type",
    "qwen2_7b": dict(layers=28, q_heads=28, kv_heads=4, head_dim=128, rope_theta=1e6, max_context=32768),
    "qwen2_yarn": "rope_scaling.type",
    "qwen3_layer_types": dict(layers=2, q_heads=16, kv_heads=8, head_dim=128),
    "mistral_7b_v01": dict(layers=32, layer_windows=(4096,), softcap=0.0, attention_sinks=False),
    "mistral_7b_v03": dict(layers=32, q_heads=32, kv_heads=8, head_dim=128, rope_theta=1e6),
    "gemma_7b": dict(layers=28, q_heads=16, kv_heads=16, head_dim=256, rotary_dim=256),
    "gemma_scalar": dict(head_dim=128, softmax_scale=1 / 12.0),
    "gemma2_9b": dict(layers=42, layer_windows=(4096, 0), softcap=50.0, softmax_scale=1 / 16.0),
    "gemma2_nowindow": dict(layer_windows=(), softcap=50.0),
    "gemma3_layer_types": "layer_types[1]",  # sliding_attention with sliding_window null
    "gemma3_pattern": dict(layers=8, layer_windows=(1024,) * 5 + (0,), softcap=0.0),
    "gemma3_local_base": "rope_local_base_freq",
    "phi2": ("--head-dim 80 (from --model-config", "head_dim"),  # the daemon's own check
    "phi_partial": dict(layers=4, q_heads=16, kv_heads=16, head_dim=128, rotary_dim=64, dtype="fp16"),
    "gptj_6b": dict(layers=28, q_heads=16, kv_heads=16, head_dim=256, rope="interleaved", rotary_dim=64,
                    max_context=2048),
    "pythia_410m": dict(layers=24, q_heads=16, kv_heads=16, head_dim=64, rotary_dim=16),
    "deepseek_v2_lite": "kv_lora_rank",
    "llava_llama": dict(layers=32, q_heads=32, kv_heads=32, head_dim=128, model_id="llama"),
    "gpt_oss": dict(layers=24, q_heads=64, kv_heads=8, head_dim=64, layer_windows=(128, 0),
                    attention_sinks=True),
    "gpt_oss_yarn": "rope_scaling.rope_type",
    "tf5_rope_parameters": dict(layers=2, q_heads=4, kv_heads=2, head_dim=64, rope_theta=250000.0,
                                max_context=4096, dtype="bf16"),
    "tf5_rope_linear": "rope_parameters.rope_type",
    "granite": dict(layers=4, q_heads=32, kv_heads=8, head_dim=64, softmax_scale=0.0078125),
    "falcon_7b": dict(layers=32, q_heads=71, kv_heads=1, head_dim=64),
    "bloom": "model_type",
    "gpt2": dict(layers=12, q_heads=12, kv_heads=12, head_dim=64, rope="none", max_context=1024),
    "not_json": "line 2",
    "no_layers": "num_hidden_layers",
    "bad_type": "num_hidden_layers",
}

# --check-config's "key = value  # origin" lines, by attnd option name.
KEYS = {"layers": "layers", "q-heads": "q_heads", "kv-heads": "kv_heads", "head-dim": "head_dim",
        "rope": "rope", "rope-theta": "rope_theta", "rotary-dim": "rotary_dim",
        "softmax-scale": "softmax_scale", "max-context": "max_context", "dtype": "dtype",
        "model-id": "model_id", "attention-windows": "layer_windows", "softcap": "softcap",
        "attention-sinks": "attention_sinks"}


def run(*args):
    return subprocess.run([daemon_binary(), "--backend", "cpu", "--kv-memory", "256M", *args],
                          capture_output=True, text=True, timeout=60)


def derived(stdout):
    """{option: (value, origin)} from --check-config's output."""
    out = {}
    for m in re.finditer(r"(?m)^([a-z-]+)\s+= (\S+)\s+# (.+)$", stdout):
        out[m.group(1)] = (m.group(2), m.group(3))
    return out


def as_python(key, text):
    if key == "layer_windows":
        return () if text == "none" else tuple(int(w) for w in text.split(","))
    if key == "attention_sinks":
        return text == "true"
    if key in ("rope_theta", "softmax_scale", "softcap"):
        return float(text)
    if key in ("rope", "dtype", "model_id"):
        return text
    return int(text)


class ModelConfigTest(unittest.TestCase):
    def setUp(self):
        if daemon_binary() is None:
            self.skipTest("attnd is not built")

    def test_every_fixture_is_expected(self):
        names = [os.path.basename(p)[:-5] for p in CONFIGS]
        self.assertEqual(sorted(names), sorted(EXPECT))

    def test_daemon_and_python_agree(self):
        for path in CONFIGS:
            name = os.path.basename(path)[:-5]
            want = EXPECT[name]
            with self.subTest(config=name):
                r = run("--model-config", path, "--check-config")
                try:
                    py = attnd.model_shape_from_config(path)
                    py_err = None
                except (attnd.UnsupportedModel, ValueError) as e:
                    py, py_err = None, e
                if isinstance(want, (str, tuple)):
                    text, field = want if isinstance(want, tuple) else (want, want)
                    self.assertEqual(r.returncode, 2, r.stdout)
                    self.assertIn(text, r.stderr)
                    self.assertEqual(r.stderr.count("\n"), 1, "one line, no usage hint: " + r.stderr)
                    if name != "not_json":
                        self.assertIsInstance(py_err, attnd.UnsupportedModel)
                        self.assertEqual(py_err.field, field)
                    continue
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertIsNone(py_err)
                d = derived(r.stdout)
                for key, attr in KEYS.items():
                    value = as_python(attr, d[key][0])
                    exp = getattr(py, attr)
                    if exp is None:  # the Python shape leaves the daemon's default
                        self.assertNotEqual(d[key][1], "model config", key)
                        continue
                    if isinstance(exp, float):
                        self.assertAlmostEqual(value, exp, delta=1e-6 * abs(exp), msg=key)
                    else:
                        self.assertEqual(value, exp, key)
                for attr, exp in want.items():
                    got = getattr(py, attr)
                    if isinstance(exp, float):
                        self.assertAlmostEqual(got, exp, delta=1e-7 * abs(exp), msg=attr)
                    else:
                        self.assertEqual(got, exp, attr)
                # The Python shape's flags describe the same daemon.
                r2 = run(*py.flags(), "--check-config")
                self.assertEqual(r2.returncode, 0, r2.stderr)
                d2 = derived(r2.stdout)
                self.assertEqual({k: v[0] for k, v in d2.items() if k in KEYS and d[k][1] == "model config"},
                                 {k: v[0] for k, v in d.items() if k in KEYS and v[1] == "model config"})

    def test_flags_and_keys_win(self):
        llama = os.path.join(HERE, "model_configs", "llama3_8b.json")
        r = run("--model-config", llama, "--layers", "2", "--check-config")
        d = derived(r.stdout)
        self.assertEqual(d["layers"], ("2", "flag"))
        self.assertEqual(d["q-heads"], ("32", "model config"))
        self.assertEqual(d["model-id"], ("llama", "model config"))
        with tempfile.TemporaryDirectory() as t:
            conf = os.path.join(t, "attnd.conf")
            with open(conf, "w") as f:
                f.write(f"model-config = {llama}\nkv-heads = 4\nmodel-id = my-llama\n")
            # A flag before --config still wins over the file, which wins over the model.
            r = run("--head-dim", "64", "--config", conf, "--check-config")
            self.assertEqual(r.returncode, 0, r.stderr)
            d = derived(r.stdout)
            self.assertEqual(d["kv-heads"], ("4", "config file"))
            self.assertEqual(d["head-dim"], ("64", "flag"))
            self.assertEqual(d["rotary-dim"], ("64", "default"))
            self.assertEqual(d["model-id"], ("my-llama", "config file"))
            self.assertEqual(d["layers"], ("32", "model config"))
            # --model-config on the command line replaces the file's.
            phi = os.path.join(HERE, "model_configs", "phi_partial.json")
            r = run("--config", conf, "--model-config", phi, "--head-dim", "256", "--check-config")
            d = derived(r.stdout)
            self.assertEqual(d["rotary-dim"], ("128", "model config"), "half of the head-dim in force")
        # A missing file is an error naming it.
        r = run("--model-config", "/nonexistent/config.json", "--check-config")
        self.assertEqual(r.returncode, 2)
        self.assertIn("/nonexistent/config.json", r.stderr)

    def test_daemon_serves_the_derived_shape(self):
        """Started with a model config and nothing else about the shape, Health reports it."""
        with tempfile.TemporaryDirectory() as t:
            path = os.path.join(t, "config.json")
            with open(path, "w") as f:
                json.dump({"model_type": "qwen2", "num_hidden_layers": 3, "num_attention_heads": 8,
                           "num_key_value_heads": 2, "hidden_size": 512, "rope_theta": 1e6,
                           "max_position_embeddings": 4096, "use_sliding_window": False,
                           "sliding_window": 4096}, f)
            d = Daemon(["--model-config", path], shape=["--backend", "cpu", "--kv-memory", "16M"])
            try:
                m = d.wait_ready().model
                self.assertEqual((m.layers, m.q_heads, m.kv_heads, m.head_dim, m.max_context),
                                 (3, 8, 2, 64, 4096))
                self.assertEqual(m.model_id, "qwen2")
                self.assertAlmostEqual(m.rope_theta, 1e6)
                self.assertEqual(attnd.model_shape_from_config(path).mismatches(m), [])
                self.assertEqual(d.stop(), 0)
            finally:
                d.close()

    def test_python_accepts_dicts_dirs_and_objects(self):
        cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
        self.assertEqual(attnd.model_shape_from_config(cfg).head_dim, 64)

        class Cfg:  # what a transformers PretrainedConfig offers
            def to_dict(self):
                return cfg
        self.assertEqual(attnd.model_shape_from_config(Cfg()).layers, 2)
        with tempfile.TemporaryDirectory() as t:
            with open(os.path.join(t, "config.json"), "w") as f:
                json.dump(cfg, f)
            self.assertEqual(attnd.model_shape_from_config(t).q_heads, 4)
        # rope="none" (the client rotates): RoPE fields neither used nor refused.
        scaled = dict(cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0})
        with self.assertRaises(attnd.UnsupportedModel):
            attnd.model_shape_from_config(scaled)
        self.assertEqual(attnd.model_shape_from_config(scaled, rope="none").rope, "none")
        try:
            import transformers
        except ImportError:
            return
        c = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     hidden_size=256, intermediate_size=512)
        s = attnd.model_shape_from_config(c)
        self.assertEqual((s.layers, s.q_heads, s.kv_heads, s.head_dim), (2, 4, 2, 64))


if __name__ == "__main__":
    unittest.main()
