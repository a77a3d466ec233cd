"""Reading a Deployment: TOML text or a dict into the schema of ``deployment``, every table
and field checked where it entered (errors name the file, the table and the field), and the
built-in default deployment that ``lockstep sim`` runs without --deployment.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import attrs

from .config import ConfigError, SchedulerConfig
from .deployment import (
    ACCEPTANCE_MODELS, HARDWARE_PRESETS, MODEL_PRESETS, ROLES, CostSpec, Deployment, EngineSpec, HardwareSpec,
    HostSpec, KVTransferSpec, ModelSpec, PoolSpec, SpeculativeSpec,
)
from .rebalance import EplbConfig

def load_deployment(path: str | Path) -> Deployment:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # (a BOM is not TOML's, nor the file's)
    except FileNotFoundError:
        raise ConfigError(f"deployment file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"deployment file {path} is a directory") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}): TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return deployment_from_dict(data, source=str(path))


def deployment_from_dict(data: dict, *, source: str = "<dict>") -> Deployment:
    known = {"name", "seed", "hash_secret", "models", "hardware", "pools", "scheduler", "cost", "host", "engine",
             "eplb", "kv_transfer", "speculative"}
    _no_unknown(data, known, source, "top level")
    models = tuple(_model(m, source, i) for i, m in enumerate(_list(data, "models", source)))
    if not models:
        raise ConfigError(f"{source}: [[models]] must list at least one model")
    _unique([m.name for m in models], source, "models")
    hardware = _hardware(_table(data, "hardware", source, {"preset": "h200"}), source)
    if "num_spec_tokens" in _table(data, "scheduler", source):
        raise ConfigError(f"{source}: [scheduler]: num_spec_tokens belongs in [speculative], next to "
                          "the draft model that proposes the tokens")
    for derived in ("num_blocks", "host_cache_blocks"):
        if derived in data.get("scheduler", {}):
            raise ConfigError(f"{source}: [scheduler]: {derived} is derived from [hardware] (hbm_bytes, "
                              "host_kv_bytes) and the model; set those (or [engine] num_blocks for the engine)")
    sched = _build(SchedulerConfig, _table(data, "scheduler", source), source, "[scheduler]")
    cost = _cost(_table(data, "cost", source), source)
    engine = _build(EngineSpec, _table(data, "engine", source), source, "[engine]")
    host = _build(HostSpec, _table(data, "host", source), source, "[host]")
    if not sched.async_scheduling:  # one setting, said twice: [host] overlap is what async scheduling does
        if _table(data, "host", source).get("overlap") is True:
            raise ConfigError(f"{source}: [scheduler] async_scheduling = false and [host] overlap = true contradict "
                              "each other (the host's work overlaps the GPU's only with async scheduling): drop one")
        host = attrs.evolve(host, overlap=False)
    eplb = _build(EplbConfig, _table(data, "eplb", source), source, "[eplb]") if "eplb" in data else None
    kv_transfer = _build(KVTransferSpec, _table(data, "kv_transfer", source), source, "[kv_transfer]")
    pools = tuple(_pool(p, source, i, models) for i, p in enumerate(_list(data, "pools", source)))
    if not pools:
        raise ConfigError(f"{source}: [[pools]] must list at least one pool")
    _unique([p.name for p in pools], source, "pools")
    for i, pool in enumerate(pools):  # expert parallelism: every rank holds as many expert slots
        m = next(m for m in models if m.name == pool.model)
        slots = m.num_routed_experts + (eplb.redundant_experts if eplb is not None else 0)
        if pool.dep > 1 and m.num_routed_experts and slots % pool.dep:  # expert parallelism: even shards
            raise ConfigError(f"{source}: [[pools]] #{i + 1} ({pool.name!r}): dep {pool.dep} must divide the "
                              f"expert slots, {m.num_routed_experts} routed experts of {m.name!r}"
                              + (f" + {eplb.redundant_experts} redundant ([eplb])" if eplb is not None else ""))
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"{source}: top level: seed must be an integer >= 0, got {seed!r}")
    for key in ("name", "hash_secret"):
        if key in data and not isinstance(data[key], str):
            raise ConfigError(f"{source}: top level: {key} must be a string, got {data[key]!r}")
    spec = _speculative(data["speculative"], source, models, pools) if "speculative" in data else None
    dep = Deployment(
        name=str(data.get("name", Path(source).stem)), models=models, hardware=hardware,
        pools=pools, scheduler=sched, cost=cost, host=host, engine=engine, eplb=eplb, kv_transfer=kv_transfer,
        speculative=spec,
        hash_secret=str(data.get("hash_secret", "lockstep")),
        seed=int(data.get("seed", 0)), source=source,
        defaulted=tuple(t for t in ("hardware",) if t not in data),
    )
    for pool in pools:
        dep.scheduler_for(pool)  # fail now if the weights do not fit, or the host tier is too small
    return dep


def _unique(names: list[str], source: str, kind: str) -> None:
    """Names a report or a lookup is keyed by: a repeat would lose one silently."""
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{source}: [[{kind}]]: names must be unique (reports and lookups are keyed by them), "
                          f"{dup} repeat")


def _list(data: dict, key: str, source: str) -> list:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{source}: {key} must be an array of tables ([[{key}]]), got {value!r}")
    return value


def _no_unknown(table: dict, allowed: set, source: str, where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{source}: {where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _check_types(cls, table: dict, source: str, where: str) -> None:
    """TOML gives ints, floats, strings and bools: refuse the wrong one here, by name."""
    for f in attrs.fields(cls):
        if f.name not in table or f.type not in _TYPES:
            continue
        value, allowed = table[f.name], _TYPES[f.type]
        if isinstance(value, bool) and f.type != "bool" or not isinstance(value, allowed):
            raise ConfigError(
                f"{source}: {where}: field {f.name!r} must be {_TYPE_NAMES[f.type]}, got {value!r}"
            )


def _table(data: dict, key: str, source: str, default=None) -> dict:
    """A [key] table (a TOML table, not a value or an array of tables)."""
    value = data.get(key, {} if default is None else default)
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key} must be a table ([{key}]), got {value!r}")
    return value


# SchedulerConfig fields a deployment derives or sets elsewhere (refused by name in [scheduler])
_NOT_IN_SCHEDULER = {"num_blocks", "host_cache_blocks", "num_spec_tokens"}


def _build(cls, table: dict, source: str, where: str):
    allowed = {f.name for f in attrs.fields(cls)} - (_NOT_IN_SCHEDULER if cls is SchedulerConfig else set())
    _no_unknown(table, allowed | (set(table) & _NOT_IN_SCHEDULER), source, where)
    _check_types(cls, table, source, where)
    missing = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING and f.name not in table]
    if missing:
        hint = " (or give a preset)" if cls is HardwareSpec else ""
        raise ConfigError(f"{source}: {where}: missing field(s) {missing}{hint}")
    try:
        return cls(**table)
    except ConfigError as e:  # (a validator may already name its table: "scheduler.block_size ...")
        raise ConfigError(f"{source}: {where}: {str(e).removeprefix(where.strip('[]') + '.')}") from None
    except TypeError as e:
        raise ConfigError(f"{source}: {where}: {e}") from None


def _cost(table: dict, source: str) -> CostSpec:
    cost = _build(CostSpec, table, source, "[cost]")
    if not cost.profile:
        return cost
    path = Path(source).parent / cost.profile
    if not path.is_file():
        raise ConfigError(f"{source}: [cost]: field 'profile': file {path} does not exist "
                          "(write it with `lockstep profile`, or remove the field for the analytic model)")
    return attrs.evolve(cost, profile=str(path))


def _model(table: dict, source: str, i: int) -> ModelSpec:
    table = dict(table)
    preset = table.pop("preset", None)
    where = f"[[models]] #{i + 1}"
    if preset is not None:
        if preset not in MODEL_PRESETS:
            raise ConfigError(f"{source}: {where}: preset must be one of {sorted(MODEL_PRESETS)}, got {preset!r}")
        base, given = MODEL_PRESETS[preset], set(table)
        layers = table.get("num_layers")
        if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 and \
                "kv_bytes_per_token" not in given:  # (the preset's KV is so many bytes a layer)
            table["kv_bytes_per_token"] = round(base["kv_bytes_per_token"] * layers / base["num_layers"])
        reshaped = sorted(given & {"num_layers", "num_dense_layers", "hidden_size", "num_shared_experts",
                                   "vocab_size"})
        if reshaped and "dense_params" not in given:
            raise ConfigError(f"{source}: {where}: {', '.join(reshaped)} change(s) preset {preset!r}'s shape, and "
                              f"dense_params (the parameters outside the routed experts: attention, dense MLPs, "
                              f"shared experts, embeddings and head; {base['dense_params']:.3g} in the preset) does "
                              "not follow: give dense_params too")
        table = {**base, "name": preset, **table}
    missing = [f.name for f in attrs.fields(ModelSpec)
               if f.default is attrs.NOTHING and f.name not in table]
    if missing:
        raise ConfigError(f"{source}: {where}: missing field(s) {missing} (or give a preset)")
    spec = _build(ModelSpec, table, source, where)
    if spec.top_k > spec.num_routed_experts:
        raise ConfigError(f"{source}: {where}: top_k ({spec.top_k}) must be <= num_routed_experts "
                          f"({spec.num_routed_experts})")
    if spec.num_dense_layers > spec.num_layers:
        raise ConfigError(f"{source}: {where}: num_dense_layers ({spec.num_dense_layers}) must be <= num_layers "
                          f"({spec.num_layers})")
    return spec


def _hardware(table: dict, source: str) -> HardwareSpec:
    table = dict(table)
    preset = table.pop("preset", None)
    if preset is not None:
        if preset not in HARDWARE_PRESETS:
            raise ConfigError(f"{source}: [hardware]: preset must be one of {sorted(HARDWARE_PRESETS)}, got {preset!r}")
        table = {**HARDWARE_PRESETS[preset], "name": preset, **table}
    return _build(HardwareSpec, table, source, "[hardware]")


MAX_POOL_GPUS = 65536  # (each rank is simulated: a larger pool would only exhaust memory)


def _pool(table: dict, source: str, i: int, models: tuple[ModelSpec, ...]) -> PoolSpec:
    where = f"[[pools]] #{i + 1}"
    if len(models) > 1 and "model" not in table:
        raise ConfigError(f"{source}: {where}: name the pool's model (model = one of {[m.name for m in models]}): "
                          "[[models]] holds several")
    table = {"name": f"pool{i}", "model": models[0].name, **table}
    pool = _build(PoolSpec, table, source, where)
    if pool.role not in ROLES:
        raise ConfigError(f"{source}: {where}: role must be one of {ROLES}, got {pool.role!r}")
    for field in ("instances", "dep"):
        if getattr(pool, field) < 1:
            raise ConfigError(f"{source}: {where}: field {field!r} must be an integer >= 1, got {getattr(pool, field)}")
    if pool.instances * pool.dep > MAX_POOL_GPUS:
        raise ConfigError(f"{source}: {where}: instances x dep must be at most {MAX_POOL_GPUS:,} GPUs, got "
                          f"{pool.instances} x {pool.dep}")
    if pool.model not in {m.name for m in models}:
        raise ConfigError(f"{source}: {where}: model {pool.model!r} is not in [[models]]")
    return pool


_SPEC_FIELDS = {  # [speculative] field -> (type name, the acceptance model it belongs to, or None)
    "draft_model": ("str", None), "num_spec_tokens": ("int", None), "acceptance": ("str", None),
    "rate": ("float", "fixed"), "rates": ("list", "per_position"), "file": ("str", "replay"),
    "adaptive": ("bool", None),
}


def _speculative(table: dict, source: str, models: tuple[ModelSpec, ...],
                 pools: tuple[PoolSpec, ...]) -> SpeculativeSpec:
    where = "[speculative]"
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: speculative must be a table ([speculative])")
    _no_unknown(table, set(_SPEC_FIELDS), source, where)
    for name, (kind, _) in _SPEC_FIELDS.items():
        if name not in table:
            continue
        value = table[name]
        ok = isinstance(value, list) if kind == "list" else (
            isinstance(value, _TYPES[kind]) and (kind == "bool" or not isinstance(value, bool)))
        if not ok:
            what = "an array of numbers" if kind == "list" else _TYPE_NAMES[kind]
            raise ConfigError(f"{source}: {where}: field {name!r} must be {what}, got {value!r}")
    for name in ("draft_model", "num_spec_tokens"):
        if name not in table:
            raise ConfigError(f"{source}: {where}: missing field {name!r}")
    # A serving deployment need not model acceptance: its engine measures it.
    model_given = any(k in table for k in ("acceptance", "rate", "rates", "file"))
    acceptance = table.get("acceptance", "fixed") if model_given else "measured"
    if acceptance not in ACCEPTANCE_MODELS:
        raise ConfigError(f"{source}: {where}: acceptance must be one of {ACCEPTANCE_MODELS}, got {acceptance!r}")
    needs = {"fixed": "rate", "per_position": "rates", "replay": "file", "measured": None}[acceptance]
    if needs is not None and needs not in table:
        raise ConfigError(f"{source}: {where}: acceptance = {acceptance!r} needs the field {needs!r}")
    for name, (_, model) in _SPEC_FIELDS.items():
        if model is not None and model != acceptance and name in table:
            raise ConfigError(f"{source}: {where}: field {name!r} belongs to acceptance = {model!r}, "
                              f"not {acceptance!r}")
    rates = table.get("rates", [])
    if any(isinstance(r, bool) or not isinstance(r, (int, float)) for r in rates):
        raise ConfigError(f"{source}: {where}: field 'rates' must be an array of numbers, got {rates!r}")
    draft = _draft_model(str(table["draft_model"]), source, models, pools)
    path, replay = str(table.get("file", "")), ()
    if acceptance == "replay":
        path = str(Path(source).parent / path)
        replay = _replay_counts(path, source)
    try:
        return SpeculativeSpec(
            draft_model=draft.name, draft=draft, num_spec_tokens=table["num_spec_tokens"],
            acceptance=acceptance, rate=float(table.get("rate", 0.0)), rates=tuple(float(r) for r in rates),
            file=path, replay=replay, adaptive=bool(table.get("adaptive", False)),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {where}: {e}") from None


def _draft_model(name: str, source: str, models: tuple[ModelSpec, ...], pools: tuple[PoolSpec, ...]) -> ModelSpec:
    """A model of [[models]] by name, else a preset; it must share the targets' vocabulary."""
    draft = next((m for m in models if m.name == name), None)
    if draft is None and name in MODEL_PRESETS:
        draft = ModelSpec(name=name, **MODEL_PRESETS[name])
    if draft is None:
        raise ConfigError(f"{source}: [speculative]: draft_model must name a model of [[models]] "
                          f"{[m.name for m in models]} or a preset {sorted(MODEL_PRESETS)}, got {name!r}")
    for target in {p.model for p in pools}:
        vocab = next(m.vocab_size for m in models if m.name == target)
        if vocab != draft.vocab_size:
            raise ConfigError(f"{source}: [speculative]: draft_model {name!r} has a vocabulary of "
                              f"{draft.vocab_size} tokens, the target {target!r} {vocab}: a draft must "
                              "share the target's tokenizer")
    return draft


def _replay_counts(path: str, source: str) -> tuple[int, ...]:
    """Drafts accepted per speculative decode: one integer >= 0 per line; blank lines and
    lines starting with # are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"{source}: [speculative]: file {path}: {e.strerror or e}") from None
    counts = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not (line.isascii() and line.isdigit()):
            raise ConfigError(f"{source}: [speculative]: file {path}, line {n}: expected the number of "
                              f"drafts accepted (an integer >= 0), got {line!r}")
        counts.append(int(line))
    return tuple(counts)


DEFAULT_DEPLOYMENT_TOML = """\
# lockstep's built-in default deployment: what `lockstep sim` uses without --deployment.
# DeepSeek-V3 (FP8) on one 8-GPU H200 node as one DEP8 instance.
name = "default"
seed = 0
hash_secret = "lockstep-default"

[[models]]
preset = "deepseek-v3"

[hardware]
preset = "h200"
host_kv_bytes = 200e9  # DRAM per GPU for the host prefix-cache tier

[[pools]]
name = "main"
role = "colocated"
model = "deepseek-v3"
instances = 1
dep = 8

[scheduler]
block_size = 16
max_num_seqs = 256
max_num_batched_tokens = 8192
enable_prefix_caching = true
max_kv_loads_per_step = 4
"""


def default_deployment() -> Deployment:
    return deployment_from_dict(tomllib.loads(DEFAULT_DEPLOYMENT_TOML), source="<built-in default>")
