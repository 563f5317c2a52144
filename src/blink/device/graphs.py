"""CUDA graphs of the GPU loop: model steps captured with torch, wrapped with the "done" kernel, instantiated for
device launch, and their handles laid out in the launch table the shim reads (``image.LAUNCH_DTYPE``).

A step graph reads only the step buffers (``step.py``), so one capture per token bucket serves every step of that
size. Every bucket's graph is instantiated twice: the resident loop fires one while the other may still be retiring
(a graph cannot be relaunched before its previous launch retires).
"""
from __future__ import annotations

import numpy as np

from blink.device.driver import check
from blink.device.image import LAUNCH_DTYPE


def capture_steps(run_step, buckets: tuple[int, ...]) -> dict:
    """One ``torch.cuda.CUDAGraph(keep_graph=True)`` of ``run_step(tokens)`` per bucket, sharing one memory pool
    (steps never run concurrently).

    Warm-up runs first on the capture stream (Triton compiles its kernels there); then the largest bucket is
    captured first, so the shared pool is sized by it. The step buffers must hold padding only (slot_mapping -1,
    logits_indices -1), so that neither warm-up nor capture writes the KV pool or sampled ids.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for tokens in buckets:
            run_step(tokens)
    stream.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for tokens in reversed(buckets):
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            run_step(tokens)
        graphs[tokens] = graph
    return graphs


def captured(stream, enqueue):
    """The graph (``CUgraph``) of what ``enqueue()`` issues on ``stream``."""
    from cuda.bindings import driver

    check(driver.cuStreamBeginCapture(stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    enqueue()
    return check(driver.cuStreamEndCapture(stream))


def instantiate(graph, stream, copies: int = 2) -> list:
    """``copies`` device-launchable, uploaded instantiations of ``graph``."""
    from cuda.bindings import runtime

    flag = runtime.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch
    upload_stream = runtime.cudaStream_t(init_value=int(stream))
    execs = []
    for _ in range(copies):
        graph_exec = check(runtime.cudaGraphInstantiateWithFlags(runtime.cudaGraph_t(init_value=int(graph)), flag))
        check(runtime.cudaGraphUpload(graph_exec, upload_stream))
        execs.append(graph_exec)
    return execs


def launch_table(buckets: tuple[int, ...], step_graph, done_graph, stream) -> tuple[np.ndarray, list]:
    """Per bucket: [the step's graph (``step_graph(tokens)``, a raw ``cudaGraph_t``)] -> [``done_graph``],
    instantiated twice. Returns the launch table (a ``LAUNCH_DTYPE`` record: the handles of both copies of each
    bucket, counters zero) and the instantiations, which must outlive every launch."""
    from cuda.bindings import driver

    table = np.zeros(1, LAUNCH_DTYPE)
    execs = []
    for b, tokens in enumerate(buckets):
        parent = check(driver.cuGraphCreate(0))
        step = driver.CUgraph(init_value=int(step_graph(tokens)))
        step_node = check(driver.cuGraphAddChildGraphNode(parent, None, 0, step))
        check(driver.cuGraphAddChildGraphNode(parent, [step_node], 1, done_graph))
        first, second = instantiate(parent, stream)
        table["graphs"][0, :, b] = int(first), int(second)
        execs += [first, second]
    return table, execs
