"""A user's `torch.nn.Module` as the runtime trains it: logical tensors, stage models, data.

`describe` builds the model once (seeded) and turns it into the runtime's geometry: one
`ParamSpec` per parameter (its pipeline unit from where it sits relative to the block list, its
tensor-parallel split from the plan) and per state buffer, plus the initial values. `StageModel`
is one rank's view of the model in one layout: the model is rebuilt on the meta device, its
block list cut to the rank's pipeline stage, and every parameter it holds replaced by a view
into the rank's flat state buffer (parameters it does not hold become zero-cost dummies).
Tensor parallelism swaps the forward of the planned `nn.Linear` / Hugging Face `Conv1D`
modules for Megatron's column- and row-parallel ones; pipeline stages are cut with two hooks
(the first block takes the previous stage's activation, the last one hands its output over).
"""

from __future__ import annotations

import contextlib
import math
import re
import types
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import default_collate

from worker_agent.runtime.errors import JobSpecError
from worker_agent.runtime.job import TensorParallel
from worker_agent.runtime.jobdef import JobDefinition
from worker_agent.runtime.layout import ModelShape
from worker_agent.sharding import Layout, ParamShard, ParamSpec, ShardMap, split_blocks


class StageOutput(Exception):
    """Raised by the last block of a non-last pipeline stage: its output goes to the next stage."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("pipeline stage boundary")
        self.output = output


@dataclass
class ModelInfo:
    """What the runner needs to know about a model job (built in a worker, never in the agent)."""

    specs: list[ParamSpec]
    n_blocks: int
    state_kinds: tuple[str, ...]
    shape: ModelShape
    static_buffers: dict[str, torch.Tensor]
    """Buffers that are not training state (position ids, rotary frequencies, counters)."""
    model_class: str
    hf_config: str | None = None
    """The Hugging Face config as JSON (for an exported directory `from_pretrained` loads)."""
    aliases: dict[str, list[str]] = field(default_factory=dict)
    """Tied tensors: primary name -> the other names of the same tensor."""
    block_path: str | None = ""
    """The block list's dotted path ("": the model is the list; None: the model has none, so it
    is one block and runs without pipeline stages)."""
    tp_modules: dict[str, str] = field(default_factory=dict)


# ----- building the geometry ------------------------------------------------------------------
def _no_cache(model: nn.Module) -> None:
    """Training needs no key/value cache; a cache would also tie blocks to their layer index
    across pipeline stages (a stage's cache misses the earlier stages' layers)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


def _get(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split(".") if path else []:
        obj = getattr(obj, part)
    return obj


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor, buffer: bool) -> None:
    owner_path, _, leaf = name.rpartition(".")
    owner = _get(root, owner_path)
    if buffer:
        owner._buffers[leaf] = value
    else:
        owner._parameters[leaf] = value


def find_blocks(model: nn.Module, hint: str | None) -> str | None:
    """Dotted path of the block list: the hint, the HF pp plan's ModuleList, the largest
    ModuleList, the largest nn.Sequential inside the model, the model itself if it is one ("");
    None when it has none (it then runs as one block: data and tensor parallel, no pipeline)."""
    if hint is not None:
        if not isinstance(_get(model, hint), nn.ModuleList | nn.Sequential):
            raise JobSpecError(f"blocks={hint!r} is not a ModuleList of the model")
        return hint
    lists: dict[str, nn.Module] = {
        name: mod
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) > 0
    }
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
    for key in plan:
        for name in lists:
            if name == key or name.endswith("." + key):
                return name
    if not lists:
        # No ModuleList: an nn.Sequential inside the model, or the model itself (path "").
        lists = {
            name: mod
            for name, mod in model.named_modules()
            if isinstance(mod, nn.Sequential) and len(mod) > 0
        }
        inner = {name: mod for name, mod in lists.items() if name}
        lists = inner or lists
    if not lists:
        return None
    return max(lists, key=lambda n: sum(p.numel() for p in lists[n].parameters()))


def _block_prefix(block_path: str) -> str:
    """What the names of the block list's members start with ("" when the model is the list)."""
    return f"{block_path}." if block_path else ""


def _in_blocks(name: str, block_path: str | None) -> bool:
    return block_path is None or name.startswith(_block_prefix(block_path))


def _pattern(pattern: str) -> re.Pattern[str]:
    body = r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(rf"(^|\.){body}$")


def _is_conv1d(mod: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer with its weight stored [in, out]."""
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")


def resolve_tp_plan(model: nn.Module, plan: Mapping[str, str] | None) -> dict[str, str]:
    """Module name -> colwise / rowwise, from the job's plan or the HF config's."""
    if plan is None:
        plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    compiled = [(_pattern(p), style) for p, style in plan.items()]
    out: dict[str, str] = {}
    for name, mod in model.named_modules():
        for pat, style in compiled:
            if style in ("colwise", "rowwise") and pat.search(name):
                if not (isinstance(mod, nn.Linear) or _is_conv1d(mod)):
                    raise JobSpecError(
                        f"tp_plan: {name} is a {type(mod).__name__}; colwise/rowwise need "
                        "nn.Linear (or Hugging Face Conv1D)"
                    )
                out[name] = style
                break
    return out


def _tp_layout(mod: nn.Module, style: str, leaf: str) -> tuple[str, bool]:
    """(kind, stored transposed) of one parameter of a TP module."""
    conv = _is_conv1d(mod)
    if leaf == "bias":
        return ("split0" if style == "colwise" else "replicated"), False
    # nn.Linear weight is [out, in]; Conv1D's is [in, out]. Colwise splits out, rowwise in;
    # the split dimension is stored first so that a shard is one contiguous range.
    transposed = (style == "rowwise") != conv
    return "split0", transposed


def describe(defn: JobDefinition) -> tuple[ModelInfo, dict[str, torch.Tensor]]:
    """Build the model once (seeded) and return its geometry and initial state tensors."""
    torch.manual_seed(defn.seed)
    model = defn.model()
    if not isinstance(model, nn.Module):
        raise JobSpecError(f"model() returned {type(model).__name__}, not a torch.nn.Module")
    _no_cache(model)
    block_path = find_blocks(model, defn.blocks)
    # No block list: the whole model is block 0 (one pipeline stage at most).
    n_blocks = 1 if block_path is None else len(_get(model, block_path))
    tp_modules = resolve_tp_plan(model, defn.tp_plan)
    modules = dict(model.named_modules(remove_duplicate=False))

    def unit_of(name: str, seen_blocks: bool) -> int:
        if block_path is None:
            return 0
        prefix = _block_prefix(block_path)
        if name.startswith(prefix):
            return int(name[len(prefix) :].split(".", 1)[0])
        return n_blocks if seen_blocks else -1

    specs: list[ParamSpec] = []
    init: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    primary: dict[int, int] = {}  # id(tensor) -> index in specs
    seen_blocks = False
    for name, p in model.named_parameters(remove_duplicate=False):
        in_blocks = _in_blocks(name, block_path)
        unit = unit_of(name, seen_blocks)
        seen_blocks = seen_blocks or in_blocks
        if id(p) in primary:
            i = primary[id(p)]
            spec = specs[i]
            if unit not in spec.units:
                specs[i] = ParamSpec(
                    spec.name,
                    spec.shape,
                    spec.kind,
                    spec.unit,
                    also_units=(*spec.also_units, unit),
                    transposed=spec.transposed,
                )
            aliases.setdefault(spec.name, []).append(name)
            continue
        owner, _, leaf = name.rpartition(".")
        kind, transposed = "replicated", False
        if owner in tp_modules:
            kind, transposed = _tp_layout(modules[owner], tp_modules[owner], leaf)
        value = p.detach().float()
        if transposed:
            value = value.t()
        primary[id(p)] = len(specs)
        specs.append(ParamSpec(name, tuple(value.shape), kind, unit, transposed=transposed))  # type: ignore[arg-type]
        init[f"param/{name}"] = value.contiguous().reshape(-1)
    static: dict[str, torch.Tensor] = {}
    seen_blocks = False
    for name, b in model.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        mod = modules[owner] if owner else model
        in_blocks = _in_blocks(name, block_path)
        unit = unit_of(name, seen_blocks)
        seen_blocks = seen_blocks or in_blocks
        persistent = leaf not in mod._non_persistent_buffers_set
        if persistent and b.is_floating_point() and name not in static:
            specs.append(ParamSpec(name, tuple(b.shape), "replicated", unit, buffer=True))
            init[f"buffer/{name}"] = b.detach().float().reshape(-1).clone()
        else:
            static[name] = b.detach().clone()
    n_params = sum(s.numel for s in specs if not s.buffer)
    divisor = _tp_divisor(model, specs, tp_modules)
    config = getattr(model, "config", None)
    hf_config = None
    if config is not None and hasattr(config, "to_json_string"):
        config.architectures = [type(model).__name__]
        hf_config = config.to_json_string()
    sample = _first_sample(defn)
    tokens = _tokens_per_sample(sample)
    width = _width(model)
    shape = ModelShape(
        n_params=n_params,
        n_blocks=n_blocks,
        tp_divisor=divisor,
        activation_elems_per_sample=tokens * width,
        flops_per_sample=6.0 * n_params * tokens,
        global_batch_size=defn.global_batch_size,
        micro_batch_size=defn.micro_batch_size,
    )
    info = ModelInfo(
        specs=specs,
        n_blocks=n_blocks,
        state_kinds=defn.optimizer.state_kinds,
        shape=shape,
        static_buffers=static,
        model_class=type(model).__name__,
        hf_config=hf_config,
        aliases=aliases,
        block_path=block_path,
        tp_modules=tp_modules,
    )
    return info, init


def _tp_divisor(model: nn.Module, specs: list[ParamSpec], tp_modules: Mapping[str, str]) -> int:
    """Every TP degree must divide this: the split dimensions, and attention heads when an
    attention projection is split (whole heads per rank)."""
    if not tp_modules:
        return 1
    div = 0
    for s in specs:
        if s.kind == "split0":
            div = math.gcd(div, s.shape[0])
    config = getattr(model, "config", None)
    if any(re.search(r"attn|attention", n) for n in tp_modules):
        for key in ("num_attention_heads", "n_head", "num_key_value_heads"):
            heads = getattr(config, key, None)
            if isinstance(heads, int) and heads > 0:
                div = math.gcd(div, heads)
    return max(div, 1)


def _first_sample(defn: JobDefinition) -> Any:
    ds = dataset_of(defn)
    return ds[0]


def _tokens_per_sample(sample: Any) -> int:
    if isinstance(sample, Mapping):
        for key in ("input_ids", "inputs"):
            v = sample.get(key)
            if isinstance(v, torch.Tensor) and v.dim() >= 1:
                return int(v.shape[-1])
    return 1


def _width(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for key in ("hidden_size", "n_embd", "d_model"):
        v = getattr(config, key, None)
        if isinstance(v, int):
            return v
    if isinstance(getattr(config, "hidden_sizes", None), list):
        return int(max(config.hidden_sizes))  # type: ignore[union-attr]
    return 1


def dataset_of(defn: JobDefinition) -> Any:
    """The job's dataset (built once if the definition gave a factory)."""
    ds = defn.dataset
    if callable(ds) and not hasattr(ds, "__getitem__"):
        ds = ds()
        defn.dataset = ds
    return ds


# ----- data -------------------------------------------------------------------------------------
def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and runs)."""
    return zlib.crc32(",".join(str(p) for p in parts).encode()) * 2_654_435_761 % (2**63 - 1)


class StepSampler:
    """Which dataset indices form each step's global batch: deterministic in (seed, step)."""

    def __init__(self, n: int, seed: int, shuffle: bool) -> None:
        if n < 1:
            raise JobSpecError("the dataset is empty")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perm: tuple[int, torch.Tensor] | None = None

    def index(self, k: int) -> int:
        """Dataset index of the k-th sample the job trains on."""
        epoch, pos = divmod(k, self.n)
        if not self.shuffle:
            return pos
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(_mix(self.seed, epoch, 17))
            self._perm = (epoch, torch.randperm(self.n, generator=gen))
        return int(self._perm[1][pos])


def load_micro_batch(
    defn: JobDefinition, sampler: StepSampler, step: int, micro: int, device: torch.device
) -> Any:
    """Micro-batch `micro` of step `step` (the same samples in every layout), on `device`."""
    ds = dataset_of(defn)
    first = step * defn.global_batch_size + micro * defn.micro_batch_size
    items = []
    with user_code("dataset"):
        for k in range(first, first + defn.micro_batch_size):
            # Random augmentation in __getitem__ draws from a stream keyed by the sample.
            torch.manual_seed(_mix(defn.seed, k, 29))
            items.append(ds[sampler.index(k)])
        batch = (defn.collate or default_collate)(items)
    return _to(batch, device)


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Turn an exception the job's own code raises into a JobSpecError naming it: the job fails
    with that reason instead of being restarted (it would raise again on any node). Out of
    memory is not the code's fault (another layout may fit) and stays what it is."""
    try:
        yield
    except (JobSpecError, StageOutput, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise JobSpecError(f"the job's {what} raised {type(exc).__name__}: {exc}") from exc


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """`model(**batch).loss` (Hugging Face models given labels)."""
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise JobSpecError("the model's output has no .loss; give the job a loss function")
    return loss


def micro_seed(seed: int, step: int, micro: int, unit: int) -> int:
    """RNG seed of one pipeline unit's forward for one micro-batch (dropout masks)."""
    return _mix(seed, step, micro, unit, 31)


# ----- tensor parallelism ---------------------------------------------------------------------
def _colwise_linear(tp: Callable[[], TensorParallel]) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(tp().copy_in(x), self.weight, self.bias)

    return forward


def _rowwise_linear(tp: Callable[[], TensorParallel]) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        y = tp().reduce_out(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    return forward


def _colwise_conv1d(tp: Callable[[], TensorParallel]) -> Callable[..., torch.Tensor]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        x = tp().copy_in(x)
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


def _rowwise_conv1d(tp: Callable[[], TensorParallel]) -> Callable[..., torch.Tensor]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        out = tp().reduce_out(x.reshape(-1, x.size(-1)) @ self.weight) + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


# ----- one rank's model -------------------------------------------------------------------------
class StageModel:
    """The model as one rank runs it in one layout, its tensors views into a flat buffer."""

    def __init__(
        self,
        defn: JobDefinition,
        info: ModelInfo,
        layout: Layout,
        rank: int,
        smap: ShardMap,
        flat: torch.Tensor,
        tp: Callable[[], TensorParallel],
    ) -> None:
        self.defn, self.info, self.layout, self.rank = defn, info, layout, rank
        self.coords = layout.coords(rank)
        device = flat.device
        with torch.device("meta"):
            model = defn.model()
        _no_cache(model)
        stage = self.coords.pp
        owned = split_blocks(info.n_blocks, layout.pp)[stage]
        self.first, self.last = stage == 0, stage == layout.pp - 1
        self.params: dict[str, nn.Parameter] = {}
        """Held parameters by primary name (module-shaped views into `flat`)."""
        self.shards: dict[str, ParamShard] = {s.spec.name: s for s in smap.params}
        held = set(self.shards)
        held_buffers = {s.spec.name: s for s in smap.buffers}
        for spec in info.specs:
            names = [spec.name, *info.aliases.get(spec.name, [])]
            if spec.buffer:
                bs = held_buffers.get(spec.name)
                if bs is not None:
                    off = smap.buffer_base + bs.offset
                    value = flat[off : off + spec.numel].view(spec.shape)
                else:
                    value = torch.zeros(spec.shape, device=device)
                for n in names:
                    if _has_owner(model, n):
                        _set_tensor(model, n, value, buffer=True)
                continue
            if spec.name in held:
                ps = self.shards[spec.name]
                seg = flat[ps.offset : ps.offset + ps.end - ps.start].view(ps.local_shape)
                param = nn.Parameter(seg.t() if spec.transposed else seg)
                self.params[spec.name] = param
            else:
                # Not held here (another stage's): a zero-cost stand-in so the modules before
                # this stage's blocks can still run (their output is replaced, see `_enter`).
                shape = spec.shape[::-1] if spec.transposed else spec.shape
                param = nn.Parameter(torch.zeros(1, device=device).expand(shape), False)
            for n in names:
                if _has_owner(model, n):
                    _set_tensor(model, n, param, buffer=False)
        for name, value in info.static_buffers.items():
            if _has_owner(model, name):
                _set_tensor(model, name, value.clone().to(device), buffer=True)
        # Names as the specs know them: taken before the block list is cut (which renumbers).
        modules = dict(model.named_modules())
        if info.block_path is None:
            # No block list: one block, the model; one stage (the layouts allow pp=1 only).
            kept = [model]
        else:
            blocks = _get(model, info.block_path)
            kept = [blocks[i] for i in owned]
            if info.block_path:
                owner_path, _, leaf = info.block_path.rpartition(".")
                cut = (
                    nn.Sequential(*kept)
                    if isinstance(blocks, nn.Sequential)
                    else nn.ModuleList(kept)
                )
                setattr(_get(model, owner_path), leaf, cut)
            else:
                # The model is the block list (an nn.Sequential): it keeps this stage's blocks.
                model._modules.clear()
                for i, block in enumerate(kept):
                    model.add_module(str(i), block)
        self.blocks = kept
        for name, style in info.tp_modules.items():
            mod = modules.get(name)
            if mod is None or layout.tp == 1:
                continue
            conv = _is_conv1d(mod)
            make = {
                ("colwise", False): _colwise_linear,
                ("rowwise", False): _rowwise_linear,
                ("colwise", True): _colwise_conv1d,
                ("rowwise", True): _rowwise_conv1d,
            }[(style, conv)]
            mod.forward = types.MethodType(make(tp), mod)  # type: ignore[method-assign]
        self.model = model
        self.stage_input: torch.Tensor | None = None
        self._unit_seed: tuple[int, int] = (0, 0)
        for i, block in zip(owned, kept, strict=True):
            block.register_forward_pre_hook(self._enter_hook(i, i == owned[0]), with_kwargs=True)
        if not self.last:
            kept[-1].register_forward_hook(self._leave)
        model.train()

    def _enter_hook(self, index: int, first_owned: bool) -> Callable[..., Any]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            step, micro = self._unit_seed
            # Dropout in block i draws the same numbers whichever stage runs it.
            torch.manual_seed(micro_seed(self.defn.seed, step, micro, index))
            if first_owned and not self.first:
                assert self.stage_input is not None
                if args:
                    return (self.stage_input, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": self.stage_input}
            return None

        return hook

    @staticmethod
    def _leave(module: nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple | list) else output
        raise StageOutput(out)

    def forward_loss(self, batch: Any, step: int, micro: int) -> torch.Tensor:
        """The micro-batch's loss (last stage) or this stage's output (others)."""
        self._unit_seed = (step, micro)
        torch.manual_seed(micro_seed(self.defn.seed, step, micro, -1))
        loss_fn = self.defn.loss or default_loss
        what = "model or loss function" if self.defn.loss else "model"
        try:
            with user_code(what):
                if self.defn.precision == "bf16":
                    device_type = "cuda" if self.flat_device().type == "cuda" else "cpu"
                    with torch.autocast(device_type, dtype=torch.bfloat16):
                        return loss_fn(self.model, batch)
                return loss_fn(self.model, batch)
        except StageOutput as out:
            return out.output

    def flat_device(self) -> torch.device:
        """Where the state lives."""
        return next(iter(self.params.values())).device if self.params else torch.device("cpu")

    def grads_into(self, grad_flat: torch.Tensor) -> None:
        """Copy every held parameter's gradient into the flat gradient buffer (zeros if none)."""
        for name, ps in self.shards.items():
            seg = grad_flat[ps.offset : ps.offset + ps.end - ps.start].view(ps.local_shape)
            view = seg.t() if ps.spec.transposed else seg
            g = self.params[name].grad
            if g is None:
                view.zero_()
            else:
                view.copy_(g)

    def zero_grad(self) -> None:
        """Drop the gradients of the last step."""
        for p in self.params.values():
            p.grad = None

    def batchnorms(self) -> Iterator[nn.modules.batchnorm._BatchNorm]:
        """BatchNorm modules of this stage that track running statistics."""
        for mod in self.model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
                yield mod


def _has_owner(model: nn.Module, name: str) -> bool:
    owner_path, _, _ = name.rpartition(".")
    try:
        _get(model, owner_path)
    except AttributeError:
        return False
    return True


# ----- checkpoints in standard formats -----------------------------------------------------------
def to_module_tensor(spec: ParamSpec, flat_logical: torch.Tensor) -> torch.Tensor:
    """A gathered logical tensor in the module's own shape (undoing the stored transpose)."""
    t = flat_logical.view(spec.shape)
    return t.t().contiguous() if spec.transposed else t.contiguous()


def from_module_tensor(spec: ParamSpec, value: torch.Tensor) -> torch.Tensor:
    """A module-shaped tensor as the runtime stores it (flattened, transposed if so stored)."""
    t = value.detach().float()
    if spec.transposed:
        t = t.t()
    if tuple(t.shape) != spec.shape:
        raise JobSpecError(f"{spec.name}: shape {tuple(value.shape)} does not fit the model")
    return t.contiguous().reshape(-1)
