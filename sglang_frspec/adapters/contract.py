"""The contract with SGLang: every SGLang name this plugin relies on, in one declarative list.

``CONTRACT`` is checked two ways with the same entries:

- live, at ``register()``, against the running SGLang (imported objects, ``inspect``), so a
  changed SGLang installs none of the plugin's hooks instead of failing half-way;
- from source, against a release's files read with ``ast`` (an installed tree or a downloaded
  wheel), so ``scripts/check_sglang_releases.py`` proves the declared range without installing it.

A target is ``"module:Qualified.name"``. Entries look only at what the named class or module
defines itself (not its bases), so both checks see the same thing. To rely on a new SGLang name,
add one line to ``CONTRACT``. This module imports nothing from SGLang at import time.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import textwrap
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from sglang_frspec.adapters.hooks import EAGLE_V2, HOOKS, REPORTER, SCHEDULER, WEIGHT_UPDATER, WORKER

logger = logging.getLogger(__name__)

LOGITS = "sglang.srt.layers.logits_processor:LogitsProcessor"
VOCAB_MODULE = "sglang.srt.layers.vocab_parallel_embedding"
VOCAB = f"{VOCAB_MODULE}:VocabParallelEmbedding"
BATCH_RESULT = "sglang.srt.managers.utils:GenerationBatchResult"
COMMITTED_FIELDS = (
    "next_token_ids",
    "accept_lens",
    "speculative_output_stride",
    "speculative_num_draft_tokens",
)
REPORTER_FIELDS = (
    "scheduler",
    "forward_ct_decode",
    "decode_log_interval",
    "is_stats_logging_rank",
    "current_scheduler_metrics_enabled",
    "metrics_collector",
)
METRICS = "sglang.srt.observability.metrics_collector"


class Missing(Exception):
    """A contract target that the SGLang being checked does not define."""


# --- the two views of an SGLang: the running one, and release source read with ast ----------


def _split(target: str) -> tuple[str, list[str]]:
    module, _, qualname = target.partition(":")
    return module, qualname.split(".") if qualname else []


def _format_params(params: list[tuple[str, str, bool]], decorator: str) -> str:
    """``classmethod (cls, a, b=, *, c=, **kw)`` from (name, kind, has_default) triples.

    Kinds are ``posonly``, ``positional``, ``varargs``, ``kwonly`` and ``varkw``; annotations and
    default values are left out (a default is marked ``=``), so live and source agree.
    """
    tokens: list[str] = []
    for i, (name, kind, has_default) in enumerate(params):
        previous = params[i - 1][1] if i else None
        if previous == "posonly" and kind != "posonly":
            tokens.append("/")
        if kind == "kwonly" and previous not in ("kwonly", "varargs"):
            tokens.append("*")
        prefix = {"varargs": "*", "varkw": "**"}.get(kind, "")
        tokens.append(prefix + name + ("=" if has_default else ""))
    if params and params[-1][1] == "posonly":
        tokens.append("/")
    return f"{decorator} ({', '.join(tokens)})".lstrip()


def _self_attributes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names assigned as ``self.NAME`` (first parameter) anywhere in a method."""
    arguments = function.args.posonlyargs + function.args.args
    if not arguments:
        return set()
    receiver = arguments[0].arg
    return {
        node.attr
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == receiver
    }


def _string_constants(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


class LiveSGLang:
    """The SGLang this process imports."""

    def __init__(self):
        self.version = _installed_version("sglang")

    def _owner(self, target: str) -> tuple[object, str]:
        module_name, path = _split(target)
        try:
            owner = importlib.import_module(module_name)
        except Exception as e:
            raise Missing(f"module {module_name} cannot be imported ({type(e).__name__}: {e})") from e
        for part in path[:-1]:
            if part not in vars(owner):
                raise Missing(f"{_short(target)}: {part} is not defined")
            owner = vars(owner)[part]
        return owner, path[-1]

    def _own(self, target: str) -> object:
        owner, name = self._owner(target)
        if name not in vars(owner):
            raise Missing(f"{_short(target)} is not defined")
        return vars(owner)[name]

    def signature(self, target: str) -> str:
        raw = self._own(target)
        decorator = {classmethod: "classmethod", staticmethod: "staticmethod", property: "property"}.get(
            type(raw), ""
        )
        function = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
        function = inspect.unwrap(function)  # a hook SGLang already applied wraps the original
        if not callable(function):
            raise Missing(f"{_short(target)} is not a function")
        kinds = {
            inspect.Parameter.POSITIONAL_ONLY: "posonly",
            inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
            inspect.Parameter.VAR_POSITIONAL: "varargs",
            inspect.Parameter.KEYWORD_ONLY: "kwonly",
            inspect.Parameter.VAR_KEYWORD: "varkw",
        }
        params = [
            (p.name, kinds[p.kind], p.default is not inspect.Parameter.empty)
            for p in inspect.signature(function).parameters.values()
        ]
        return _format_params(params, decorator)

    def has_attribute(self, target: str) -> bool:
        owner, name = self._owner(target)
        if name in vars(owner) or name in vars(owner).get("__annotations__", {}):
            return True
        return inspect.isclass(owner) and name in self._instance_attributes(owner)

    @cache  # noqa: B019 (classes live as long as the process)
    def _instance_attributes(self, cls: type) -> set[str]:
        """``self.NAME`` assignments in the class's own methods, read from their current source."""
        names: set[str] = set()
        for member in vars(cls).values():
            function = getattr(member, "fget", None) or getattr(member, "__func__", member)
            if not inspect.isfunction(function):
                continue
            try:
                source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
            except (OSError, TypeError):  # no source (built at run time): it proves no name
                continue
            for node in ast.parse(source).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    names |= _self_attributes(node)
        return names

    def strings(self, target: str) -> set[str]:
        value = self._own(target)
        if isinstance(value, str):
            return {value}
        return {v for v in value if isinstance(v, str)}

    def names_string(self, module_name: str, word: str) -> bool:
        module, _ = self._owner(f"{module_name}:_")
        return word in _string_constants(ast.parse(inspect.getsource(module)))


class SourceSGLang:
    """An SGLang release read as source: an installed ``site-packages`` folder or a wheel."""

    def __init__(self, root: Path | zipfile.ZipFile, version: str):
        self.root = root
        self.version = version

    @cache  # noqa: B019 (one instance per release; the cache lives as long as the check)
    def _module(self, module_name: str) -> ast.Module:
        relative = module_name.replace(".", "/")
        for candidate in (f"{relative}.py", f"{relative}/__init__.py"):
            if isinstance(self.root, zipfile.ZipFile):
                source = self.root.read(candidate) if candidate in self.root.namelist() else None
            else:
                source = (self.root / candidate).read_bytes() if (self.root / candidate).is_file() else None
            if source is not None:
                try:
                    return ast.parse(source)
                except SyntaxError as e:  # newer syntax than this Python reads
                    raise Missing(f"module {module_name} cannot be parsed ({e})") from e
        raise Missing(f"module {module_name} does not exist")

    def _find(self, module_name: str, path: list[str], target: str, follow: int = 3) -> ast.AST:
        """The definition of ``path`` in a module, following ``from X import name`` re-exports."""
        scope: ast.AST = self._module(module_name)
        for depth, part in enumerate(path):
            found = None
            for statement in _statements(scope.body):
                if isinstance(statement, ast.ImportFrom) and depth == 0 and follow:
                    for alias in statement.names:
                        if (alias.asname or alias.name) == part:
                            source = _absolute(module_name, statement, self._is_package(module_name))
                            return self._find(source, [alias.name, *path[1:]], target, follow - 1)
                if _defines(statement, part):
                    found = statement
            if found is None:
                raise Missing(f"{_short(target)} is not defined")
            scope = found
        return scope

    def _is_package(self, module_name: str) -> bool:
        init = module_name.replace(".", "/") + "/__init__.py"
        if isinstance(self.root, zipfile.ZipFile):
            return init in self.root.namelist()
        return (self.root / init).is_file()

    def signature(self, target: str) -> str:
        module_name, path = _split(target)
        node = self._find(module_name, path, target)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            raise Missing(f"{_short(target)} is not a function")
        decorators = {
            d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list
        }
        decorator = next((d for d in ("classmethod", "staticmethod", "property") if d in decorators), "")
        a = node.args
        positional = a.posonlyargs + a.args
        first_default = len(positional) - len(a.defaults)
        params = [
            (arg.arg, "posonly" if i < len(a.posonlyargs) else "positional", i >= first_default)
            for i, arg in enumerate(positional)
        ]
        if a.vararg:
            params.append((a.vararg.arg, "varargs", False))
        params += [(arg.arg, "kwonly", d is not None) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
        if a.kwarg:
            params.append((a.kwarg.arg, "varkw", False))
        return _format_params(params, decorator)

    def has_attribute(self, target: str) -> bool:
        module_name, path = _split(target)
        owner = self._find(module_name, path[:-1], target) if len(path) > 1 else self._module(module_name)
        name = path[-1]
        if any(_defines(s, name) for s in _statements(owner.body)):
            return True
        return isinstance(owner, ast.ClassDef) and any(
            name in _self_attributes(f)
            for f in owner.body
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        )

    def strings(self, target: str) -> set[str]:
        module_name, path = _split(target)
        node = self._find(module_name, path, target)
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            raise Missing(f"{_short(target)} is not a constant")
        return _string_constants(node.value)

    def names_string(self, module_name: str, word: str) -> bool:
        return word in _string_constants(self._module(module_name))


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a module or class body, including those under if/try/with (not the body of
    ``if TYPE_CHECKING:``, which never runs: its imports are often cycles back to the module)."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If | ast.Try | ast.With):
            type_checking = isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test)
            nested = [
                *([] if type_checking else statement.body),
                *getattr(statement, "orelse", []),
                *getattr(statement, "finalbody", []),
            ]
            for handler in getattr(statement, "handlers", []):
                nested += handler.body
            yield from _statements(nested)


def _defines(statement: ast.stmt, name: str) -> bool:
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return statement.name == name
    if isinstance(statement, ast.Assign):
        return any(name in _assigned_names(t) for t in statement.targets)
    if isinstance(statement, ast.AnnAssign):
        return name in _assigned_names(statement.target)
    if isinstance(statement, ast.Import | ast.ImportFrom):
        return any((a.asname or a.name.split(".")[0]) == name for a in statement.names)
    return False


def _assigned_names(target: ast.expr) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(_assigned_names(t) for t in target.elts))
    return set()


def _absolute(module_name: str, statement: ast.ImportFrom, is_package: bool) -> str:
    if not statement.level:
        return statement.module or ""
    base = module_name.split(".")
    base = base[: len(base) - statement.level + (1 if is_package else 0)]
    return ".".join([*base, *([statement.module] if statement.module else [])])


def _short(target: str) -> str:
    """``Class.method`` (or ``module.name``) for messages."""
    module_name, path = _split(target)
    return ".".join(path) if len(path) > 1 else f"{module_name}.{'.'.join(path)}"


def _installed_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


# --- entries ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """A function or method the plugin calls, overrides or hooks, with its parameter list.

    ``params`` is what ``_format_params`` prints, e.g. ``"(self, x, y=)"``; None accepts any
    parameters (hooks that pass ``*args`` through).
    """

    target: str
    params: str | None

    def problem(self, sglang: LiveSGLang | SourceSGLang) -> str | None:
        found = sglang.signature(self.target)
        if self.params is not None and found != self.params:
            return f"{_short(self.target)} takes {found}, not {self.params}"
        return None


@dataclass(frozen=True)
class Attribute:
    """A name the class (or module) defines: a method, property, field, enum member, a
    module-level name or import, or an instance attribute assigned on ``self`` in one of the
    class's own methods (an assignment the code can make, not one proven to run)."""

    target: str

    def problem(self, sglang: LiveSGLang | SourceSGLang) -> str | None:
        return None if sglang.has_attribute(self.target) else f"{_short(self.target)} is not defined"


@dataclass(frozen=True)
class Contains:
    """A constant collection (a set literal, a frozenset) that must hold a string."""

    target: str
    value: str

    def problem(self, sglang: LiveSGLang | SourceSGLang) -> str | None:
        if self.value in sglang.strings(self.target):
            return None
        return f"{_short(self.target)} no longer holds {self.value!r}"


@dataclass(frozen=True)
class Named:
    """A name SGLang resolves dynamically (``__getattr__`` over tables): the weaker check is
    that the module's source still spells it as a string."""

    module: str
    word: str

    @property
    def target(self) -> str:
        return f"{self.module}:{self.word}"

    def problem(self, sglang: LiveSGLang | SourceSGLang) -> str | None:
        return (
            None
            if sglang.names_string(self.module, self.word)
            else f"{self.module} no longer names {self.word!r}"
        )


Entry = Signature | Attribute | Contains | Named

# What the argument-time refusal itself needs (see ``refuse_token_map_at_tp``).
ARGUMENT_TIME: tuple[Entry, ...] = (
    Signature("sglang.srt.arg_groups.resolution_hooks:register_resolution_hook", "(name)"),
    Contains("sglang.srt.arg_groups.resolution_hooks:_OVERRIDABLE_HOOKS", "handle_speculative_decoding"),
    Signature("sglang.srt.arg_groups.model_override_base:resolving_view", "(server_args)"),
    Attribute("sglang.srt.arg_groups.fields.spec:Spec.speculative_token_map"),
    Attribute("sglang.srt.arg_groups.fields.spec:Spec.speculative_algorithm"),
    Attribute("sglang.srt.arg_groups.fields.parallel:Parallel.tp_size"),
)

CONTRACT: tuple[Entry, ...] = (
    *ARGUMENT_TIME,
    # plugin.py: the hook registry
    Signature(
        "sglang.srt.plugins.hook_registry:HookRegistry.register",
        "classmethod (cls, target, hook, hook_type=, *, source=)",
    ),
    Attribute("sglang.srt.plugins.hook_registry:HookRegistry._patched"),
    *(Attribute(f"sglang.srt.plugins.hook_registry:HookType.{k}") for k in sorted({h.kind for h in HOOKS})),
    # hooks.py: every hooked target, with the parameters its handler relies on
    *(Signature(target, params) for target, params in dict.fromkeys((h.target, h.params) for h in HOOKS)),
    # args.py: server arguments read through resolving_view
    Attribute("sglang.srt.arg_groups.fields.spec:Spec.enable_multi_layer_eagle"),
    Attribute("sglang.srt.arg_groups.fields.model:Model.model_path"),
    Attribute("sglang.srt.arg_groups.fields.model:Model.load_format"),
    Attribute("sglang.srt.arg_groups.fields.model:Model.trust_remote_code"),
    Attribute("sglang.srt.arg_groups.fields.model:Model.revision"),
    # worker.py: the EAGLE draft worker (hooked methods, what the hooks call and read)
    Signature(f"{WORKER}._resolve_shared_embed_and_head", "(self)"),
    Attribute(f"{WORKER}.hot_token_id"),
    Attribute(f"{WORKER}.draft_runner"),
    Attribute(f"{WORKER}.target_worker"),
    Attribute(f"{WORKER}.speculative_algorithm"),
    Attribute(f"{WORKER}.topk"),
    Signature("sglang.srt.speculative.spec_info:SpeculativeAlgorithm.is_eagle3", "(self)"),
    Attribute("sglang.srt.managers.tp_worker:TpModelWorker.model_runner"),
    Attribute("sglang.srt.managers.tp_worker:TpModelWorker.model_config"),  # adapt.py: the EOS ids
    Attribute("sglang.srt.model_executor.model_runner:ModelRunner.model"),
    Attribute("sglang.srt.model_executor.model_runner:ModelRunner.dtype"),
    # the EAGLE draft model (Llama family): its head swap and the attributes the plugin replaces
    Signature("sglang.srt.models.llama:LlamaForCausalLM.set_embed_and_head", "(self, embed, head)"),
    Attribute("sglang.srt.models.llama_eagle:LlamaForCausalLMEagle.lm_head"),
    Attribute("sglang.srt.models.llama_eagle:LlamaForCausalLMEagle.logits_processor"),
    Attribute("sglang.srt.models.llama_eagle:LlamaForCausalLMEagle.config"),
    # worker.py and head.py: parallel state
    Signature("sglang.srt.runtime_context:get_parallel", "()"),
    Signature("sglang.srt.runtime_context:get_spec", "()"),
    Named("sglang.srt.runtime_context", "tp_group"),
    Named("sglang.srt.runtime_context", "tp_rank"),
    Named("sglang.srt.runtime_context", "attn_tp_group"),
    Named("sglang.srt.runtime_context", "attn_tp_rank"),
    Signature(
        "sglang.srt.distributed.parallel_state:GroupCoordinator.all_gather_into_tensor",
        "(self, output, input)",
    ),
    Signature("sglang.srt.distributed.parallel_state:GroupCoordinator.all_gather_object", "(self, obj)"),
    Attribute("sglang.srt.distributed.parallel_state:GroupCoordinator.world_size"),
    # plugin.py and worker.py: weight updates (AFTER hooks pass the arguments through)
    Attribute(f"{WEIGHT_UPDATER}.draft_worker"),
    Attribute(f"{EAGLE_V2}._draft_worker"),
    Attribute("sglang.srt.managers.io_struct:EndWeightUpdateReqOutput.success"),
    # coverage.py (and an AFTER hook on init_lm_head, above): the committed tokens of each verify
    # step, and where the scheduler reports
    *(Attribute(f"{BATCH_RESULT}.{name}") for name in COMMITTED_FIELDS),
    Attribute("sglang.srt.managers.schedule_batch:ScheduleBatch.forward_mode"),
    Signature("sglang.srt.model_executor.forward_batch_info:ForwardMode.is_idle", "(self)"),
    *(Attribute(f"{REPORTER}.{name}") for name in REPORTER_FIELDS),
    Attribute(f"{SCHEDULER}.metrics_reporter"),
    Attribute(f"{SCHEDULER}.draft_worker"),
    Attribute(f"{SCHEDULER}.model_config"),
    Attribute("sglang.srt.configs.model_config:ModelConfig.hf_eos_token_id"),
    Attribute(f"{METRICS}:SchedulerMetricsCollector.labels"),
    Attribute(f"{METRICS}:_StatLoggerDIMixin._counter_cls"),
    Signature("sglang.srt.runtime_context:get_serving", "()"),
    Attribute("sglang.srt.arg_groups.fields.serving:Serving.tokenizer_path"),
    Named("sglang.srt.runtime_context", "tp_size"),
    # pd.py: the hot indices a PD prefill node ships and a decode node receives, and the mode
    # that makes a node a PD node
    Attribute("sglang.srt.managers.schedule_batch:Req.output_topk_index"),
    Attribute("sglang.srt.speculative.eagle_info:EagleDraftInput.topk_index"),
    Signature("sglang.srt.runtime_context:get_disagg", "()"),
    Attribute("sglang.srt.arg_groups.fields.disagg:Disagg.disaggregation_mode"),
    # token_map.py: SGLang's own map loader (hub paths)
    Signature("sglang.srt.speculative.spec_utils:load_token_map", "(token_map_path)"),
    # head.py: the target's vocab-parallel LM head
    Attribute(f"{VOCAB_MODULE}:ParallelLMHead"),
    # head.py: SGLang's own test of whether a draft head's quant method runs over its weight
    Signature(
        "sglang.srt.layers.logits_processor:should_apply_lm_head_quant_method", "(lm_head, quant_method)"
    ),
    # quantized_head.py: the ModelOpt FP8 head whose stored layout it reads back
    Attribute("sglang.srt.layers.quantization.modelopt_quant:ModelOptFp8LinearMethod"),
    Attribute("sglang.srt.layers.quantization.modelopt_quant:ModelOptFp8LinearMethod.use_marlin"),
    Signature(
        f"{VOCAB}._get_indices",
        "classmethod (cls, vocab_size_padded, org_vocab_size_padded, vocab_size, org_vocab_size, "
        "tp_rank, tp_size)",
    ),
    *(
        Attribute(f"{VOCAB}.{name}")
        for name in (
            "quant_method",
            "embedding_dim",
            "enable_tp",
            "tp_size",
            "use_attn_tp_group",
            "num_embeddings",
            "num_embeddings_padded",
            "num_embeddings_per_partition",
            "org_vocab_size",
            "org_vocab_size_padded",
            "shard_indices",
        )
    ),
    Attribute(f"{VOCAB_MODULE}:VocabParallelEmbeddingShardIndices.org_vocab_start_index"),
    Attribute(f"{VOCAB_MODULE}:VocabParallelEmbeddingShardIndices.org_vocab_end_index"),
    # logits.py: the draft logits processor subclass
    Attribute("sglang.srt.layers.logits_processor:LogitsMetadata"),
    Signature(f"{LOGITS}.__init__", "(self, config, skip_all_gather=, logit_scale=, return_full_logits=)"),
    Signature(
        f"{LOGITS}._get_logits",
        "(self, hidden_states, lm_head, logits_metadata, embedding_bias=, use_logits_buffer=)",
    ),
    Signature(f"{LOGITS}._compute_lm_head", "(self, hidden_states, lm_head, embedding_bias=, *, out=)"),
    Attribute("sglang.srt.layers.logits_processor:fused_softcap"),
    Signature(f"{LOGITS}._gather_dp_attn_hidden_states", "(self, hidden_states, logits_metadata)"),
    Signature(f"{LOGITS}._scatter_dp_attn_logits", "(self, logits, local_hidden_states, logits_metadata)"),
    Signature(f"{LOGITS}._copy_logits_to_buffer", "(self, logits, logits_metadata, use_buffer=, softcap=)"),
    *(
        Attribute(f"{LOGITS}.{name}")
        for name in (
            "vocab_size",
            "use_fp32_lm_head",
            "use_fp32_lm_head_output",  # from the config's enable_lm_head_output_fp32
            "logit_scale",
            "final_logit_softcapping",
        )
    ),
)


def problems(sglang: LiveSGLang | SourceSGLang, entries: tuple[Entry, ...] = CONTRACT) -> list[str]:
    """What ``sglang`` lacks or changed, one short phrase per broken entry."""
    found = []
    for entry in entries:
        try:
            problem = entry.problem(sglang)
        except Missing as e:
            problem = str(e)
        if problem is not None and problem not in found:
            found.append(problem)
    return found


def declared_range() -> str:
    """The SGLang requirement this installed sglang-frspec declares (from its metadata)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        for requirement in requires("sglang-frspec") or ():
            if requirement.replace(" ", "").startswith("sglang") and requirement[6:7] in "<>=!~ ":
                return requirement.replace(" ", "")
    except PackageNotFoundError:
        pass
    return "sglang (see the README's compatibility table)"


def mismatch_message(version: str, found: list[str], refused: bool = True) -> str:
    """The one line logged at register() (and raised at argument time)."""
    from sglang_frspec import __version__

    consequence = (
        "so --speculative-token-map at --tp-size > 1 is refused (TP=1 runs stock SGLang)"
        if refused
        else "and SGLang's argument-resolution hooks changed too, so a token map at --tp-size > 1 "
        "is not even refused: it crashes as in stock SGLang"
    )
    return (
        f"sglang-frspec {__version__} does not support SGLang {version}: {'; '.join(found)}. "
        f"None of its hooks are installed, {consequence}. Install a supported SGLang "
        f"({declared_range()}) or a sglang-frspec release that supports this one."
    )


def refuse_token_map_at_tp(message: str) -> None:
    """Register the one resolution hook left when the contract fails: a token map with EAGLE at
    TP > 1 (what stock SGLang crashes on) fails at argument time with ``message``."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    from sglang_frspec.core import UnsupportedSetupError

    def refuse(server_args, previous: Callable) -> None:
        previous(server_args)  # resolves NEXTN to EAGLE
        cfg = resolving_view(server_args)
        if cfg.speculative_token_map is not None and cfg.speculative_algorithm == "EAGLE" and cfg.tp_size > 1:
            raise UnsupportedSetupError(message)

    register_resolution_hook("handle_speculative_decoding")(refuse)


@dataclass(frozen=True)
class ContractCheck:
    """What ``check_running_sglang`` found: ``holds``, or the logged ``message`` and whether the
    argument-time refusal can still be registered (``refusable``)."""

    holds: bool
    message: str = ""
    refusable: bool = False


def check_running_sglang() -> ContractCheck:
    """Check the running SGLang against the contract; a broken one is logged in one line."""
    live = LiveSGLang()
    found = problems(live)
    if not found:
        return ContractCheck(holds=True)
    refusable = not problems(live, ARGUMENT_TIME)
    message = mismatch_message(live.version, found, refused=refusable)
    logger.error(message)
    return ContractCheck(holds=False, message=message, refusable=refusable)


def compatibility_table(results: list[tuple[str, list[str]]], tested: str) -> str:
    """The README's compatibility table: one row per (release, problems), newest first."""
    lines = [f"| SGLang | contract ({len(CONTRACT)} entries) | test suite |", "|---|---|---|"]
    for version, found in results:
        contract = "holds" if not found else "broken: " + "; ".join(found)
        suite = "runs on it (constraints.txt)" if version == tested else "not run"
        lines.append(f"| {version} | {contract} | {suite} |")
    return "\n".join(lines)
