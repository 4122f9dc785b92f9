"""An API-format ComfyUI workflow checked whole before anything runs, its refusals in ComfyUI's
own shape (execution.py ``validate_prompt``): ``{"error": {type, message, details,
extra_info}, "node_errors": {node id: {"errors": [...], "dependent_outputs", "class_type"}}}``.

Checked here, against the node table (comfyui_nodes.py): the node count (before any node is
read), each node's ``class_type`` and ``inputs``, every required input present, each link
``[node id, output index]`` to a node that exists and an output of the type the input takes, each
value's type, range and list, the graph free of cycles, and the rows its sweeps ask for (each
sweep's ``n`` summed, before any is expanded). What the nodes mean together (a
sampler pair, a size, a LoRA's strengths) is checked when the workflow is planned
(comfyui_plan.py), also before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .comfyui_nodes import NodeSpec

# A workflow's nodes, counted before any is read: ComfyUI's own default graph has 7, a large
# hand-built one a few hundred; past this a body is a mistake or an attack, and checking it
# (links, a cycle search) would cost the event loop for nothing.
MAX_NODES = 1000


class WorkflowRefused(Exception):
    """A workflow that cannot run: ComfyUI's ``error`` and ``node_errors``, answered 400."""

    def __init__(self, error: dict, node_errors: Optional[dict] = None):
        super().__init__(error["message"])
        self.error = error
        self.node_errors = node_errors or {}

    def body(self) -> dict:
        return {"error": self.error, "node_errors": self.node_errors}


def error(type_: str, message: str, details: str = "", **extra: Any) -> dict:
    """One of ComfyUI's error records."""
    return {"type": type_, "message": message, "details": details, "extra_info": extra}


def input_error(type_: str, message: str, name: str, details: str = "", **extra: Any) -> dict:
    """A node input's error, naming the input (``extra_info.input_name``) as ComfyUI does."""
    return error(type_, message, details or name, input_name=name, **extra)


@dataclass(frozen=True)
class Workflow:
    """A checked workflow: its nodes (id -> {class_type, inputs}), its output nodes in id order,
    and the order the nodes they need are computed in (each after the nodes it links to)."""

    nodes: dict
    outputs: tuple[str, ...]
    order: tuple[str, ...]


def is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int)) and isinstance(value[1], int)


def refused_prompt(message: str, details: str = "", node_errors: Optional[dict] = None) -> WorkflowRefused:
    kind = "prompt_outputs_failed_validation" if node_errors else "invalid_prompt"
    return WorkflowRefused(error(kind, message, details), node_errors)


def checked_workflow(prompt: Any, table: dict[str, NodeSpec], max_nodes: int = MAX_NODES,
                     max_rows: Optional[int] = None) -> Workflow:  # fmt: skip
    """``prompt`` (the body's ``prompt``) as a :class:`Workflow`, or :class:`WorkflowRefused`
    naming every node that cannot run, input by input. ``max_rows``: the most rows the nodes
    that count them (a sweep's ``n``) may ask for together (None: no bound)."""
    if not isinstance(prompt, dict):
        raise refused_prompt("prompt: an API-format workflow is an object of nodes by id", type(prompt).__name__)
    if len(prompt) > max_nodes:
        raise refused_prompt(f"prompt: {len(prompt)} nodes, at most {max_nodes} per workflow", f"{len(prompt)} > {max_nodes}")
    node_errors: dict[str, dict] = {}

    def fail(node_id: str, reason: dict) -> None:
        entry = node_errors.setdefault(node_id, {"errors": [], "dependent_outputs": [],
                                                 "class_type": (prompt.get(node_id) or {}).get("class_type")})  # fmt: skip
        entry["errors"].append(reason)

    for node_id, node in prompt.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            fail(node_id, error("invalid_prompt", "Cannot execute because a node is missing the class_type property.",
                                f"Node ID '#{node_id}'"))  # fmt: skip
            continue
        kind = node["class_type"]
        if kind not in table:
            fail(node_id, error("invalid_prompt", f"Cannot execute because node {kind} does not exist.",
                                f"Node ID '#{node_id}': edit-rt runs {', '.join(sorted(table))}"))  # fmt: skip
            continue
        if not isinstance(node.get("inputs", {}), dict):
            fail(node_id, error("invalid_prompt", "inputs: an object of input values and links", f"Node ID '#{node_id}'"))
            continue
        for reason in node_input_errors(prompt, node, table[kind], table):
            fail(node_id, reason)
    outputs = tuple(sorted((i for i, n in prompt.items() if i not in node_errors and table[n["class_type"]].output_node),
                           key=_id_key))  # fmt: skip
    if not node_errors and not outputs:
        raise WorkflowRefused(error("prompt_no_outputs", "Prompt has no outputs",
                                    "add a SaveImage or PreviewImage node"))  # fmt: skip
    order, cycle = _topological(prompt, outputs) if not node_errors else ((), [])
    for node_id in cycle:
        fail(node_id, error("dependency_cycle", "Dependency cycle detected",
                            f"node {node_id} is linked, through {' -> '.join(cycle)}, to itself"))  # fmt: skip
    counted = [(i, table[prompt[i]["class_type"]].rows_input) for i in order]
    counted = [(i, name, prompt[i]["inputs"][name]) for i, name in counted if name is not None]
    rows = sum(n for _, _, n in counted)
    if max_rows is not None and rows > max_rows:
        for node_id, name, n in counted:
            fail(node_id, input_error("too_many_rows", f"The workflow's sweeps ask for {rows} rows, at most {max_rows}",
                                      name, f"{name}: {n} of {rows} rows; this server runs at most {max_rows} "
                                      "(serve.max_edits_per_request): lower n", received_value=n))  # fmt: skip
    if node_errors:
        for entry in node_errors.values():
            entry["dependent_outputs"] = list(outputs)
        details = "\n".join(f"{r['message']}: {r['details']}" for e in node_errors.values() for r in e["errors"])
        first = next(iter(node_errors.values()))["errors"][0]
        kind = "invalid_prompt" if first["type"] == "invalid_prompt" and len(node_errors) == 1 else None
        if kind:
            raise WorkflowRefused(first, node_errors)
        raise refused_prompt("Prompt outputs failed validation", details, node_errors)
    return Workflow(prompt, outputs, order)


def node_input_errors(prompt: dict, node: dict, spec: NodeSpec, table: dict[str, NodeSpec]) -> list[dict]:
    """Every input error of one node: missing, a bad link, a value of the wrong type or out of range."""
    inputs = node.get("inputs", {})
    out = []
    for name, info in {**spec.required, **spec.optional}.items():
        if name not in inputs:
            if name in spec.required:
                out.append(input_error("required_input_missing", "Required input is missing", name))
            continue
        value, kind = inputs[name], info[0]
        if is_link(value):
            out.extend(_link_errors(prompt, table, name, info, value))
            continue
        if isinstance(kind, str) and kind not in ("INT", "FLOAT", "STRING", "BOOLEAN"):
            out.append(input_error("bad_linked_input", "Bad linked input, must be a length-2 list of [string, int]",
                                   name, f"{name}: a {kind} comes from a link [node id, output index]"))  # fmt: skip
            continue
        out.extend(_value_errors(name, info, value, inputs))
    return out


def _link_errors(prompt: dict, table: dict[str, NodeSpec], name: str, info: tuple, link: list) -> list[dict]:
    """A link to a node that exists, at an output it has, of the type the input takes."""
    source_id, slot = str(link[0]), link[1]
    source = prompt.get(source_id)
    if not isinstance(source, dict) or source.get("class_type") not in table:
        why = "is not in the workflow" if not isinstance(source, dict) else "cannot run (its own error)"
        return [input_error("bad_linked_input", "Bad linked input, the node it links to does not exist", name,
                            f"{name}: node {source_id} {why}", linked_node=link)]  # fmt: skip
    outputs = table[source["class_type"]].outputs
    if not 0 <= slot < len(outputs):
        return [input_error("bad_linked_input", "Bad linked input, the output it links to does not exist", name,
                            f"{name}: node {source_id} has {len(outputs)} outputs; index {slot}", linked_node=link)]  # fmt: skip
    if outputs[slot] != info[0]:
        return [input_error("return_type_mismatch", "Return type mismatch between linked nodes", name,
                            f"{name}, received_type({outputs[slot]}) mismatch input_type({info[0]})",
                            received_type=outputs[slot], linked_node=link)]  # fmt: skip
    return []


def _value_errors(name: str, info: tuple, value: Any, inputs: dict) -> list[dict]:
    kind, options = info[0], (info[1] if len(info) > 1 else {})
    if isinstance(kind, list):
        if not isinstance(value, (str, int, float)) or value not in kind:
            shown = str(kind) if len(kind) <= 20 else f"(list of length {len(kind)})"
            return [input_error("value_not_in_list", "Value not in list", name, f"{name}: '{value}' not in {shown}",
                                input_config=list(info), received_value=value)]  # fmt: skip
        return []
    try:
        if isinstance(value, bool) or isinstance(value, (list, dict)) or value is None:
            raise ValueError(f"{type(value).__name__} is not a {kind}")
        converted = {"INT": int, "FLOAT": float, "STRING": str, "BOOLEAN": bool}[kind](value)
        if kind == "INT" and isinstance(value, float) and value != int(value):
            raise ValueError("not a whole number")
    except (ValueError, TypeError) as err:
        return [input_error("invalid_input_type", f"Failed to convert an input value to a {kind} value", name,
                            f"{name}, {value}, {err}", received_value=value)]  # fmt: skip
    inputs[name] = converted
    if "min" in options and converted < options["min"]:
        return [input_error("value_smaller_than_min", f"Value {converted} smaller than min of {options['min']}", name,
                            received_value=converted)]  # fmt: skip
    if "max" in options and converted > options["max"]:
        return [input_error("value_bigger_than_max", f"Value {converted} bigger than max of {options['max']}", name,
                            received_value=converted)]  # fmt: skip
    return []


def _id_key(node_id: str):
    return (0, int(node_id), "") if node_id.isdigit() else (1, 0, node_id)


def _topological(prompt: dict, outputs: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
    """The nodes the outputs need, each after those it links to (iterative: a deep chain cannot
    exhaust the stack), and a cycle among them ([] when there is none)."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in outputs:
        if state.get(root) == 2:
            continue
        path: list[str] = [root]
        stack = [(root, iter(_links_of(prompt[root])))]
        state[root] = 1
        while stack:
            node_id, links = stack[-1]
            nxt = next(links, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node_id] = 2
                order.append(node_id)
                continue
            if state.get(nxt) == 1:
                return (), path[path.index(nxt):] + [nxt]
            if state.get(nxt) is None:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(_links_of(prompt[nxt]))))
    return tuple(order), []


def _links_of(node: dict) -> list[str]:
    return [str(v[0]) for v in node.get("inputs", {}).values() if is_link(v)]
