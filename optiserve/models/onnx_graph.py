"""Nodes added to an ONNX graph that came from elsewhere, under one prefix so that no name clashes
with the file's own: what the input adapter puts before a foreign model and a detector head's
decoding after it. Only operators whose signature is the same from opset 11 on are used, so the
additions fit the file's own opset."""

from __future__ import annotations

import numpy as np

MIN_OPSET = 11  # Round, ScatterND, GatherElements and TopK's `largest` came with opset 11


class GraphEdit:
    """Adds constants (as initializers) and nodes to `model`'s graph; `nodes` collects the nodes in
    the order they were made, for the caller to put before or after the graph's own."""

    def __init__(self, model, prefix: str):
        self.model, self.prefix, self.nodes, self._count = model, prefix, [], 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}/{hint}_{self._count}"

    def const(self, value, dtype=np.float32, hint: str = "const") -> str:
        from onnx import numpy_helper

        name = self.fresh(hint)
        self.model.graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, **attributes):
        """One node; returns its output's name (a list of names where it has several)."""
        from onnx import helper

        names = outputs if isinstance(outputs, list) else [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self.fresh(op_type), **attributes))
        return names[0] if len(names) == 1 else names

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        """x[..., start:end, ...] along `axis` (end may be past the axis: to its end)."""
        return self.op("Slice", [x, self.const([start], np.int64), self.const([end], np.int64),
                                 self.const([axis], np.int64)])

    def reshape(self, x: str, shape: list[int]) -> str:
        """Reshape where 0 keeps that axis as it is (the batch)."""
        return self.op("Reshape", [x, self.const(shape, np.int64)])


def renamed_uses(graph, old: str, new: str) -> None:
    """Every node that reads `old` (in `graph` and the subgraphs of its If/Loop/Scan nodes) reads `new`."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for attribute in node.attribute:
            for sub in [attribute.g, *attribute.graphs] if attribute.type in (5, 10) else []:
                renamed_uses(sub, old, new)
