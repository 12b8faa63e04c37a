#!/usr/bin/env python3
"""bench/summarize.py: the decode table of one GPU round, from the JSON that
bench_kernels ($OUT/bench.json) and torch_reference.py ($OUT/reference.json)
wrote in the same command: % of the read roof per cache type and shape, step
time against cuDNN SDPA over contiguous bf16 KV, the shape sweep against the
d128 / GQA 4 / block 64 row, uneven batches and small-batch launch sequences.

usage: summarize.py bench.json [reference.json]
(bench.json may be several bench_kernels outputs merged: see merge_json.)
"""
import json
import sys

KV = ["bf16", "fp16", "int8", "fp8", "int8_dynamic", "fp8_dynamic", "int4"]


def main():
    b = json.load(open(sys.argv[1]))
    r = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {}
    roof = b.get("read_bw", {}).get("GBps", 0)
    copy = b.get("copy_bw", {}).get("GBps", 0)
    print(f"read roof {roof:.0f} GB/s (bench read_bw), copy {copy:.0f} GB/s; "
          f"torch read {r.get('read_bw', {}).get('GBps', 0)}, copy {r.get('copy_bw', {}).get('GBps', 0)}")
    print("\n% of read roof (target >= 90, int4 >= 80); step time / cuDNN bf16 (target <= 0.55 for the dynamic types)")
    print(f"{'shape':<16}" + "".join(f"{k:>14}" for k in KV))
    for B, ctx in ((64, 4096), (8, 32768)):
        cud = r.get(f"decode_bf16_cudnn_B{B}_ctx{ctx}", {}).get("us")
        row, rat = f"B{B} ctx{ctx}".ljust(16), "  vs cuDNN".ljust(16)
        for k in KV:
            d = b.get(f"decode_B{B}_ctx{ctx}_{k}", {})
            row += f"{d.get('pct_read', float('nan')):>14.1f}"
            rat += f"{(d['us'] / cud) if cud and 'us' in d else float('nan'):>14.2f}"
        print(row)
        print(rat + (f"   (cuDNN {cud} us)" if cud else ""))
    print("\nsweep B64 ctx4096: fraction relative to the d128/GQA4/bs64 row of the same type (target within 0.90..1.10)")
    print(f"{'variant':<16}" + "".join(f"{k:>14}" for k in KV))
    for v in ("d64", "d256", "gqa1", "gqa8", "gqa16", "bs16", "bs128"):
        cells = ""
        for k in KV:
            base = b.get(f"decode_B64_ctx4096_{k}", {}).get("pct_read")
            p = b.get(f"sweep_B64_ctx4096_{v}_{k}", {}).get("pct_read")
            cells += f"{(p / base) if base and p else float('nan'):>14.2f}"
        print(v.ljust(16) + cells)
    print("\nuneven (64 sessions, 128..32768): % of read roof (target >= 80), flat / per-item split")
    print("".ljust(16) + "".join(
        f"{b.get(f'uneven_B64_{k}', {}).get('pct_read', float('nan')):>7.1f}/"
        f"{b.get(f'uneven_B64_{k}', {}).get('pct_read_per_item', float('nan')):<6.1f}" for k in KV))
    print("\nsmall batches, ctx 4096: us of device time per layer step (write + attention + merge); "
          "targets B1 <= 10, B8 <= 15")
    for B in (1, 8):
        for k in ("bf16", "int8_dynamic", "fp8", "int4"):
            d = b.get(f"small_B{B}_ctx4096_{k}")
            if not d:
                continue
            seq = {n: v for n, v in d.items() if n.endswith(("_single_us", "_graph_us")) and v > 0}
            best = min((v, n) for n, v in seq.items())
            print(f"B{B} {k:<13} best {best[0]:6.1f} us ({best[1]}), floor {d['floor_us']:.1f} us, "
                  f"write alone {d.get('write_alone_us', 0):.1f}, attention alone {d.get('attend_alone_us', 0):.1f}; " +
                  ", ".join(f"{n[:-3]} {v:.1f}" for n, v in seq.items()))
    for n in ("decode_bf16_cudnn_B1_ctx4096", "decode_bf16_flash_B1_ctx4096"):
        if n in r:
            print(f"  torch {n}: {r[n].get('us')} us")


if __name__ == "__main__":
    main()
