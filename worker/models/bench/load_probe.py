"""How fast model files can reach the GPU from the page cache: the ceiling a loader works against.

For every *.safetensors under a folder (the benchmark's random-weight model files), once warm in the
page cache:
  - `cat` of all of them, one process (what the cold-start goal compares against);
  - read into one pinned host buffer by T threads at once (pread of 64 MiB chunks), T = 1, 2, 4, 8;
  - the same with each chunk's asynchronous copy to the device queued behind it (the staged loader's
    shape, with T threads each owning two pinned halves);
  - pinned host → device copies alone (64 MiB, 256 MiB), and pageable ones.
Prints one JSON object. Usage: python3 load_probe.py DIR [--max-gb 30]
"""

import argparse
import json
import os
import subprocess
import threading
import time

import torch

CHUNK = 64 << 20


def files_under(root, max_bytes):
    out, total = [], 0
    for dirpath, _, names in sorted(os.walk(root)):
        for n in sorted(names):
            if n.endswith(".safetensors"):
                p = os.path.join(dirpath, n)
                s = os.path.getsize(p)
                if total + s > max_bytes and out:
                    continue
                out.append((p, s))
                total += s
    return out, total


def chunks_of(files):
    for path, size in files:
        for off in range(0, size, CHUNK):
            yield path, off, min(CHUNK, size - off)


def threaded(files, threads, to_device):
    work = list(chunks_of(files))
    lock = threading.Lock()
    idx = [0]
    dev = torch.device("cuda")
    dst = torch.empty(CHUNK * 8, dtype=torch.uint8, device=dev) if to_device else None

    def run():
        bufs = [torch.empty(CHUNK, dtype=torch.uint8).pin_memory() for _ in range(2)]
        events = [None, None]
        stream = torch.cuda.Stream() if to_device else None
        fds = {}
        k = 0
        while True:
            with lock:
                if idx[0] >= len(work):
                    break
                path, off, n = work[idx[0]]
                idx[0] += 1
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            b = bufs[k % 2]
            if events[k % 2] is not None:
                events[k % 2].synchronize()
            mv = memoryview(b.numpy())[:n]
            got = 0
            while got < n:
                got += os.preadv(fd, [mv[got:]], off + got)
            if to_device:
                with torch.cuda.stream(stream):
                    slot = (k % 8) * CHUNK
                    dst[slot:slot + n].copy_(b[:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events[k % 2] = ev
            k += 1
        if to_device:
            stream.synchronize()
        for fd in fds.values():
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def h2d(nbytes, pinned, repeats=5):
    src = torch.empty(nbytes, dtype=torch.uint8)
    if pinned:
        src = src.pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    return nbytes * repeats / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--max-gb", type=float, default=30)
    a = ap.parse_args()
    files, total = files_under(a.dir, int(a.max_gb * 1e9))
    gb = total / 1e9
    res = {"files": len(files), "gb": round(gb, 3)}
    subprocess.run(["cat"] + [p for p, _ in files], stdout=subprocess.DEVNULL, check=True)  # warm
    t0 = time.perf_counter()
    subprocess.run(["cat"] + [p for p, _ in files], stdout=subprocess.DEVNULL, check=True)
    res["cat_s"] = round(time.perf_counter() - t0, 3)
    for to_device in (False, True):
        for threads in (1, 2, 4, 8):
            s = threaded(files, threads, to_device)
            key = f"{'to_gpu' if to_device else 'read'}_{threads}t"
            res[key + "_gbps"] = round(gb / s, 2)
    for mb in (64, 256):
        res[f"h2d_pinned_{mb}mb_gbps"] = round(h2d(mb << 20, True), 2)
        res[f"h2d_pageable_{mb}mb_gbps"] = round(h2d(mb << 20, False), 2)
    res["cat_gbps"] = round(gb / res["cat_s"], 2)
    print("load_probe " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
