# SPDX-License-Identifier: Apache-2.0
"""Runs a test body on N real processes joined by a process group (gloo; nccl for the CUDA tests)."""
import multiprocessing as mp
import os
import tempfile
import traceback


def _worker(fn, rank, world, init_file, args, queue, backend):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share 2 cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method="file://" + init_file, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may be gone already
                pass


def run(fn, world, *args, timeout=120, expect_dead=(), backend="gloo"):
    """Runs fn(rank, world, *args) on `world` processes; returns the results by rank. Raises when a
    rank raised (with its traceback) or when the run outlives `timeout` (processes are killed).
    Ranks in expect_dead may die without reporting."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(fn, r, world, init_file, args, queue, backend)) for r in range(world)]
        for p in procs:
            p.start()
        results, errors = {}, []
        want = world - len(expect_dead)
        try:
            while len(results) + len(errors) < want:
                rank, status, payload = queue.get(timeout=timeout)
                if status == "ok":
                    results[rank] = payload
                elif rank not in expect_dead:
                    errors.append(f"rank {rank}:\n{payload}")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results.get(r) for r in range(world)]
