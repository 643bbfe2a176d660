"""A pool's ``parallelism`` in the CRD schema (pure data), and the admission rules that go with it.

``parallelism.tensor: N`` (prefill and each decode pool) splits the model over N tensor-parallel ranks,
one process each, all in the pool's one pod (``--tensor-parallel-size N``; ``parallelism.py`` renders
it). The API server refuses, each with a message naming the numbers:

- a GPU pool whose GPUs per pod (its one GPU resource of ``crd_pod.GPU_RESOURCES`` or MIG slices, from
  limits, else requests) differ from N: each rank runs on its own GPU, so fewer GPUs than ranks cannot
  start and more leave GPUs idle (N defaults to 1, so a pool asking for 4 GPUs without ``parallelism``
  is refused too: it used to load everything onto the first and leave three idle);
- a GPU pool naming several GPU resources (nvidia.com/gpu and amd.com/gpu, or two MIG profiles): the
  ranks of a pod run on one kind of GPU;
- a MIG pool with N > 1: a CUDA process sees one MIG device only (NVIDIA's MIG user guide, "CUDA device
  enumeration"), and rank r of this engine opens ``cuda:r``;
- N > 1 with ``engine.name`` vllm or sim (their servers run one rank and exit at start otherwise);
- ``engine.extraArgs`` naming ``--tensor-parallel-size`` (the field says it).

A CPU pool takes any N: its ranks are gloo processes. It should ask for N cpu at least, one core per
rank (each rank is a process with its own torch threads, and every all-reduce waits for the slowest, so
two ranks sharing a core wait on each other every layer); ``parallelism.py`` gives each rank cpu // N
threads. That is documented, not refused: a cpu quantity cannot be compared in a CRD rule at a cost
the API server accepts (below).
"""

from __future__ import annotations

from pdserve.operator.crd_pod import GPU_NAMES, GPU_RESOURCE_PREFIXES, GPU_RESOURCES, gpu_cel
from pdserve.operator.crd_schema import _int, _obj, _rule

MAX_TENSOR = 16  # ranks of one pod, so GPUs of one node: 8 on most GPU nodes, 16 on the largest
FLAG = "--tensor-parallel-size"

PARALLELISM = _obj(
    {"tensor": _int(f"Tensor-parallel ranks of each pod ({FLAG}): the model's heads, MLP rows and vocabulary are "
                    "split over this many processes of the pod, one per GPU on a GPU pool (the pod's GPUs must be "
                    "this many), gloo processes on a CPU pool (give it at least this many cpu: one core per rank). "
                    "Default 1.",
                    1, MAX_TENSOR)},
    description="How each pod of the pool splits the model (docs/parallelism.md).",
)


def tensor_cel(pool: str) -> str:
    """CEL: the pool's tensor-parallel size (parallelism.tensor, else 1)."""
    return f"((has({pool}.parallelism) && has({pool}.parallelism.tensor)) ? {pool}.parallelism.tensor : 1)"


def _named(key: str) -> str:
    return " || ".join([*(f"{key} == '{name}'" for name in GPU_RESOURCES),
                        *(f"{key}.startsWith('{prefix}')" for prefix in GPU_RESOURCE_PREFIXES)])


def _part(pool: str) -> str:
    """CEL: the resource map GPUs are counted in: limits when they name a GPU, else requests (which then do:
    use only where ``gpu_cel(pool)`` holds)."""
    limits, requests = f"{pool}.resources.limits", f"{pool}.resources.requests"
    return f"((has({limits}) && {limits}.exists(k, {_named('k')})) ? {limits} : {requests})"


def _gpu_keys(pool: str) -> str:
    """CEL: the GPU resource names of the pool (of ``_part``)."""
    return f"{_part(pool)}.filter(k, {_named('k')})"


def _mig(pool: str) -> str:
    prefixes = " || ".join(f"k.startsWith('{p}')" for p in GPU_RESOURCE_PREFIXES)
    return f"{_part(pool)}.exists(k, {prefixes})"


# The flag and every abbreviation argparse takes for it (the servers' parsers allow them, and no other of their
# flags starts with --te): --te, --ten, ..., --tensor-parallel-size.
SPELLINGS = [FLAG[:n] for n in range(len("--te"), len(FLAG) + 1)]


def _flag_taken(pool: str) -> str:
    spellings = "[" + ", ".join(f"'{f}'" for f in SPELLINGS) + "]"
    return f"{pool}.engine.extraArgs.exists(a, a in {spellings} || {spellings}.exists(f, a.startsWith(f + '=')))"


def _tensor_text(pool: str) -> str:
    """CEL (messages): the tensor-parallel size as text, by index into literals (string() of an int counts as
    a string of unknown length in the cost estimate, so a message concatenating it is refused as too costly)."""
    return f"[{', '.join(repr(str(n)) for n in range(MAX_TENSOR + 1))}][{tensor_cel(pool)}]"


# A resource quantity is an int-or-string, which CEL's cost estimate takes as a string as long as a whole request:
# a rule that parses one (int(), quantity(), matches()) is refused as too costly, for every pool. So the count is
# compared, not parsed: the one GPU resource's value equals the size as a number or as its decimal string (a
# count written otherwise, 4000m, is refused, and named as written).
POOL_RULES = [
    _rule(f"!{gpu_cel('self')} || {_gpu_keys('self')}.size() == 1",
          f"resources must name one GPU resource ({GPU_NAMES}), not several: the ranks of a pod run on one kind "
          "of GPU, one each", fieldPath=".resources"),
    {**_rule(f"!{gpu_cel('self')} || {_gpu_keys('self')}.size() != 1 || {_gpu_keys('self')}.all(k, "
             f"{_part('self')}[k] == {tensor_cel('self')} || {_part('self')}[k] == string({tensor_cel('self')}))",
             "parallelism.tensor must equal the pod's GPUs"),
     "messageExpression": f"'parallelism.tensor is ' + {_tensor_text('self')} + ' (default 1) but resources give "
                          f"each pod ' + string({_part('self')}[{_gpu_keys('self')}[0]]) + ' GPUs (' + "
                          f"{_gpu_keys('self')}[0] + '): each tensor-parallel rank runs on one GPU of the pod, so the "
                          "two must be equal (set parallelism.tensor to the GPUs, or ask for as many GPUs as ranks)'",
     "fieldPath": ".parallelism"},
    _rule(f"!{gpu_cel('self')} || !{_mig('self')} || {tensor_cel('self')} == 1",
          "parallelism.tensor must be 1 on MIG slices (nvidia.com/mig-*): a CUDA process sees one MIG device only, "
          "so the ranks of one pod cannot each open their own; use whole GPUs (nvidia.com/gpu)",
          fieldPath=".parallelism"),
    _rule(f"{tensor_cel('self')} == 1 || !has(self.engine) || !has(self.engine.name) || "
          "self.engine.name == 'builtin'",
          "parallelism.tensor above 1 needs engine.name builtin: the vllm backend (vLLM's CPU build) and the sim "
          "run one rank, and their servers refuse --tensor-parallel-size at start", fieldPath=".parallelism"),
    _rule(f"!has(self.engine) || !has(self.engine.extraArgs) || !{_flag_taken('self')}",
          f"engine.extraArgs must not set {FLAG}: use parallelism.tensor (the operator renders the flag, and "
          "admission checks it against the pod's GPUs)", fieldPath=".engine.extraArgs"),
]
