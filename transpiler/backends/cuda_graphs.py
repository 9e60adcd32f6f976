"""backend="cudagraphs": each program as one CUDA graph of the whole step.

The program's device part is compiled by inductor (without inductor's own
cudagraph trees, which skip a graph that writes its inputs, and a training step
writes every parameter) and captured here with torch.cuda.CUDAGraph: forward,
backward, collectives (nccl captures them) and the optimizer update, replayed
with one launch. Parameters, buffers, optimizer state and held tensors are
read and written where they live (their addresses are the graph's; a moved one
captures again); the batch, the hyperparameters and the incoming .grad are
copied into the graph's own input buffers before each replay.

What runs on the host each call stays outside the graph: the program's CPU
work that depends on its inputs (torch's default Adam counts its steps in a CPU
tensor) is split off and run op by op before the replay. A program that cannot
be captured (device code reading such a host value, collectives on a process
group that is not nccl, a capture that fails) runs compiled without a graph,
and the log says why, once per program.

A program is captured at its second run: its first run (the compile's) warms it
up on the capture's stream, so that lazily created handles, workspaces and
communicators exist before capture. A program run once (the first step, which
creates the optimizer state) is never captured.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from ..program.program import graph_module
from ..world import backend_for
from ..program.roles import COMM

log = logging.getLogger("transpiler")


@dataclasses.dataclass
class HostSplit:
    """A program cut in two: `host` computes, op by op, its CPU values that
    depend on its inputs (with their writes into CPU inputs); `device` the rest.
    Both take all of the program's inputs. outputs[i]: where output i comes
    from, (True, j) the host part's j-th output, (False, j) the device part's."""

    host: fx.GraphModule | None
    device: fx.GraphModule
    outputs: list[tuple[bool, int]]
    crossing: str | None   # why the device part cannot be captured, if it cannot


def _on_host(node: fx.Node) -> bool:
    val = node.meta.get("val")
    values = val if isinstance(val, (tuple, list)) else [val]
    return all(not isinstance(v, torch.Tensor) or v.device.type == "cpu" for v in values)


def split_host(gm: fx.GraphModule) -> HostSplit:
    """Split off the CPU work that changes from call to call: CPU inputs and
    the CPU nodes computed from them. CPU values computed from no input are
    constants: they stay where they are used (a graph may hold a constant).
    Where device code reads such a varying host value the program is not split
    (crossing says why it cannot be captured)."""
    graph, out = gm.graph, gm.graph.output_node()
    varying: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if isinstance(node.meta.get("val"), torch.Tensor) and _on_host(node):
                varying.add(node)
        elif node.op == "call_function" and _on_host(node):
            if any(a in varying for a in node.all_input_nodes):
                varying.add(node)
    unsplit = HostSplit(None, gm, [(False, i) for i in range(len(out.args[0]))], None)
    for node in graph.nodes:
        read = [a for a in node.all_input_nodes if a in varying]
        if node.op == "call_function" and node not in varying and read:
            unsplit.crossing = (f"device code ({node.target}) reads {read[0].name}, a CPU "
                                "value that changes from call to call; a CUDA graph would "
                                "keep its value at capture")
            return unsplit
    host_nodes = [n for n in graph.nodes if n in varying and n.op == "call_function"]
    if not host_nodes:
        return unsplit

    host, env = fx.Graph(), {}

    def copy_into_host(node: fx.Node) -> fx.Node:
        if node not in env:
            for arg in node.all_input_nodes:
                copy_into_host(arg)
            env[node] = host.node_copy(node, lambda a: env[a])
        return env[node]

    for node in graph.nodes:
        if node.op == "placeholder" or node in varying:
            copy_into_host(node)
    outputs, host_values, device_values = [], [], []
    for value in out.args[0]:
        if value in varying:
            outputs.append((True, len(host_values)))
            host_values.append(env[value])
        else:
            outputs.append((False, len(device_values)))
            device_values.append(value)
    host.output(tuple(host_values))

    device = copy.deepcopy(graph)
    by_name = {n.name: n for n in device.nodes}
    device.output_node().args = (tuple(by_name[v.name] if isinstance(v, fx.Node) else v
                                       for v in device_values),)
    for node in reversed(host_nodes):
        device.erase_node(by_name[node.name])
    return HostSplit(graph_module(gm, host), graph_module(gm, device), outputs, None)


def collectives_not_capturable(gm: fx.GraphModule) -> str | None:
    """Why the program's collectives cannot be captured (None if they can):
    nccl captures its collectives into a CUDA graph, gloo runs them on the host."""
    if not dist.is_initialized() or not any(COMM in n.meta for n in gm.graph.nodes):
        return None
    backend = backend_for("cuda")
    if backend != "nccl":
        return (f"its collectives run on {backend!r}, which a CUDA graph cannot capture "
                "(nccl can: init_process_group('nccl'))")
    return None


class WholeStepGraph:
    """A compiled program's device part as one CUDA graph.

    static[i]: input i keeps its address from call to call (parameters,
    buffers, optimizer state, held tensors) and is used in place; the other
    CUDA inputs are copied into buffers of the graph before each replay, and
    those the program writes (written[i]) copied back after it. fresh[j]:
    output j is returned to the caller, who may keep it: a copy, since the
    graph's outputs are overwritten at the next replay."""

    def __init__(self, compiled: Callable, static: list[bool], written: list[bool],
                 fresh: list[bool], name: str):
        self.compiled, self.static, self.written, self.fresh = compiled, static, written, fresh
        self.name = name
        self.runs = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False
        self.status = "not captured yet: a program is captured at its second run"
        self.stream = torch.cuda.Stream()

    def __call__(self, *inputs) -> list:
        self.runs += 1
        if self.failed or self.runs == 1:
            return self._uncaptured(inputs)
        if self.graph is not None and any(inputs[i].data_ptr() != address
                                          for i, address in self.addresses):
            log.info("transpiler: program %r captured again: a parameter, buffer or state "
                     "tensor it uses in place is another tensor now", self.name)
            self.graph = None
        if self.graph is None and not self._capture(inputs):
            return self._uncaptured(inputs)
        for i in self.copied:
            self.buffers[i].copy_(inputs[i])
        self.graph.replay()
        for i in self.copied:
            if self.written[i]:
                inputs[i].copy_(self.buffers[i])
        return [o.clone() if fresh else o for o, fresh in zip(self.outputs, self.fresh)]

    def _uncaptured(self, inputs) -> list:
        """Run without a graph, on the capture's stream (a warm-up for it)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            outputs = list(self.compiled(*inputs))
        torch.cuda.current_stream().wait_stream(self.stream)
        return outputs

    def _capture(self, inputs) -> bool:
        on_device = [isinstance(v, torch.Tensor) and v.is_cuda for v in inputs]
        self.addresses = [(i, v.data_ptr()) for i, v in enumerate(inputs)
                          if self.static[i] and on_device[i]]
        self.copied = [i for i in range(len(inputs)) if on_device[i] and not self.static[i]]
        self.buffers = list(inputs)
        for i in self.copied:
            self.buffers[i] = inputs[i].clone()
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=self.stream):
                self.outputs = list(self.compiled(*self.buffers))
        except Exception as exc:  # noqa: BLE001 - logged; the program runs without a graph
            self.failed = True
            self.status = f"not captured: the capture failed ({type(exc).__name__}: {exc})"
            log.warning("transpiler: program %r %s; it runs compiled, without a CUDA graph",
                        self.name, self.status)
            return False
        self.graph = graph
        self.status = "captured"
        log.info("transpiler: program %r captured as one CUDA graph", self.name)
        return True
