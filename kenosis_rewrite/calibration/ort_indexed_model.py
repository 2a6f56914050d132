"""ORT's quantizer model wrapper (``ONNXModel``) with its name lookups indexed, for
:mod:`kenosis_rewrite.calibration.ort_static`.

ORT's QDQ quantizer finds initializers and rewires a tensor's readers by walking the whole graph in
Python, once per tensor it quantizes; :class:`ScanningONNXModel` answers the same lookups from
dictionaries kept in step with every change the quantizer makes, so the quantized model is the
same, byte for byte. ORT's private parts come through :mod:`kenosis_rewrite._upstream.ort_quantizer`.
"""

from __future__ import annotations

import collections
import collections.abc

import onnx

from kenosis_rewrite._upstream.ort_quantizer import NameIndexed, ONNXModel

__all__ = ["IndexedInitializers", "ScanningONNXModel"]


class IndexedInitializers(NameIndexed, collections.abc.Sequence):
    """A :class:`ScanningONNXModel`'s initializers as ORT's quantizer reads them (it iterates over
    them, and passes them to ``find_by_name``), with the model's indexed lookup beside (what
    :func:`~kenosis_rewrite._upstream.ort_quantizer.indexed_initializer_lookups` answers from)."""

    def __init__(self, model: ScanningONNXModel):
        self._model = model

    def __len__(self) -> int:
        return len(self._model.model.graph.initializer)

    def __getitem__(self, index):
        return self._model.model.graph.initializer[index]

    def __iter__(self):
        return iter(self._model.model.graph.initializer)

    def first_named(self, name: str) -> onnx.TensorProto | None:
        return self._model.get_initializer(name)



class ScanningONNXModel(ONNXModel):
    """ORT's ``ONNXModel``, its name lookups indexed. ORT finds an initializer by walking all of
    them in Python (``add_initializer``, and ``get_initializer`` for each DequantizeLinear added) and
    rewires a tensor's readers by walking every input of every node (``replace_input_of_all_nodes``),
    once per tensor it quantizes: quadratic in the graph (0.22 s of YOLOv8n's 0.44 s
    quantize_static). Here both are dictionaries, built on first use and kept in step by every
    ``ONNXModel`` method that adds, removes, reorders or rewires nodes or initializers (the only ways
    the QDQ quantizer changes the graph); a count that no longer matches the graph rebuilds them.
    The same lookups, replacements and initializers, hence the same model (the tests compare it
    byte for byte with quantize_static's)."""

    def __init__(self, model: onnx.ModelProto):
        super().__init__(model)
        # ORT checks only float8 initializers (for NaN bytes), and the quantizations handled here add none
        self._float8_free = all(init.data_type != onnx.TensorProto.FLOAT8E4M3FN for init in model.graph.initializer)
        self._by_name: dict[str, onnx.TensorProto] | None = None  # the first initializer of each name
        self._by_name_count = 0
        self._repeated_names: set[str] = set()  # names more than one initializer has (invalid, but ORT copes)
        self._readers: dict[str, list[onnx.NodeProto]] | None = None  # a superset of each tensor's readers
        self._readers_count = 0

    def _initializer_index(self) -> dict[str, onnx.TensorProto]:
        initializers = self.model.graph.initializer
        if self._by_name is None or self._by_name_count != len(initializers):
            self._by_name, self._repeated_names = {}, set()
            for init in initializers:
                self._index_initializer(init)
            self._by_name_count = len(initializers)
        return self._by_name

    def _index_initializer(self, init: onnx.TensorProto) -> None:
        if init.name in self._by_name:
            self._repeated_names.add(init.name)
        else:
            self._by_name[init.name] = init

    def _appended_initializer(self, init: onnx.TensorProto) -> None:
        self.model.graph.initializer.append(init)
        if self._by_name is not None and self._by_name_count == len(self.model.graph.initializer) - 1:
            self._index_initializer(self.model.graph.initializer[-1])  # the graph's copy
            self._by_name_count += 1

    def _reader_index(self) -> dict[str, list[onnx.NodeProto]]:
        nodes = self.model.graph.node
        if self._readers is None or self._readers_count != len(nodes):
            self._readers = collections.defaultdict(list)
            for node in nodes:
                for name in dict.fromkeys(node.input):
                    self._readers[name].append(node)
            self._readers_count = len(nodes)
        return self._readers

    def _forget_indices(self) -> None:
        self._by_name = self._readers = None

    def reader_count(self, name: str) -> int:
        """``len(input_name_to_nodes()[name])`` (ORT's: one entry per input of a node that reads
        ``name``), from the reader index instead of a map of the whole graph built for one name."""
        readers = {id(node): node for node in self._reader_index().get(name, ())}  # a superset, repeats
        return sum(1 for node in readers.values() for input_name in node.input if input_name == name)

    def get_initializer(self, name):
        return self._initializer_index().get(name)

    def initializer(self):
        return IndexedInitializers(self)

    def add_initializer(self, tensor):
        if tensor.name not in self._initializer_index():
            self.check_initializer(tensor)
            self._appended_initializer(tensor)

    def initializer_extend(self, inits):
        """ORT's, without checking every initializer already there again at each call (quadratic: a
        bias's three tensors each walked them all); those checks pass on a model without float8 ones."""
        if not self._float8_free:
            super().initializer_extend(inits)
            self._forget_indices()
            return
        if len(inits) == 0:
            raise ValueError("Can add an empty list.")
        for init in inits:
            self.check_initializer(init)
            self._appended_initializer(init)

    def add_node(self, node):
        super().add_node(node)
        nodes = self.model.graph.node
        if self._readers is not None and self._readers_count == len(nodes) - 1:
            for name in dict.fromkeys(nodes[-1].input):
                self._readers[name].append(nodes[-1])  # the graph's copy
            self._readers_count += 1

    def replace_node_input(self, node, old_input_name, new_input_name):
        ONNXModel.replace_node_input(node, old_input_name, new_input_name)
        if self._readers is not None:
            self._readers[new_input_name].append(node)

    def replace_input_of_all_nodes(self, old_input_name, new_input_name):
        readers = self._reader_index()
        for node in readers.pop(old_input_name, ()):
            ONNXModel.replace_node_input(node, old_input_name, new_input_name)  # no-op where rewired since
            readers[new_input_name].append(node)

    def replace_output_of_all_nodes(self, old_output_name, new_output_name):
        """ORT's, the names compared in the node's own container before a call per node (once per
        removable Relu/Clip, each a walk over the graph)."""
        for node in self.model.graph.node:
            if old_output_name in node.output:
                ONNXModel.replace_node_output(node, old_output_name, new_output_name)

    def replace_input_of_nodes(self, old_input_name, new_input_name, node_names_set):
        super().replace_input_of_nodes(old_input_name, new_input_name, node_names_set)
        self._forget_indices()

    def remove_node(self, node):
        super().remove_node(node)
        self._readers = None

    def remove_initializer(self, tensor):
        count = len(self.model.graph.initializer)
        super().remove_initializer(tensor)
        removed = len(self.model.graph.initializer) == count - 1
        if (self._by_name is not None and removed and self._by_name_count == count
                and tensor.name not in self._repeated_names):
            # ORT removes the first initializer equal to ``tensor``: the one of its name
            del self._by_name[tensor.name]
            self._by_name_count -= 1
        elif removed:
            self._by_name = None

    def clean_initializers(self):
        try:
            return super().clean_initializers()
        finally:
            self._forget_indices()

    def topological_sort(self):
        super().topological_sort()
        self._forget_indices()

    def replace_gemm_with_matmul(self):
        super().replace_gemm_with_matmul()
        self._forget_indices()

    def remove_unused_constant(self):
        super().remove_unused_constant()
        self._forget_indices()
