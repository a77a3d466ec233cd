"""The Deployment schema: the shipped examples load, and bad input names the field."""

import copy
import re
import tomllib
from pathlib import Path

import attrs
import pytest

from lockstep.policy.config import ConfigError, SchedulerConfig
from lockstep.policy.deployment import Deployment
from lockstep.policy.deployment_file import (
    DEFAULT_DEPLOYMENT_TOML, default_deployment, deployment_from_dict, load_deployment,
)

EXAMPLES = Path(__file__).parents[1] / "examples"
BASE = tomllib.loads(DEFAULT_DEPLOYMENT_TOML)


def test_examples_exist():
    assert (EXAMPLES / "default.toml").exists()
    assert len(list(EXAMPLES.glob("*.toml"))) >= 2


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_loads(path):
    profile = tomllib.loads(path.read_text()).get("cost", {}).get("profile")
    if profile and not (path.parent / profile).exists():  # written by a GPU run (lockstep profile)
        pytest.skip(f"{path.name}: its profile {profile} is not measured yet")
    d = load_deployment(path)
    assert isinstance(d, Deployment) and d.source == str(path)
    assert d.models and d.pools and d.num_gpus == sum(p.instances * p.dep for p in d.pools)
    for pool in d.pools:
        d.model(pool.model)
        cfg = d.scheduler_for(pool)
        assert isinstance(cfg, SchedulerConfig)
        assert cfg.num_blocks == d.kv_blocks_per_rank(pool) >= 16
        assert cfg.max_model_len <= d.model(pool.model).context_length
    assert load_deployment(path) == d  # loading is deterministic


def test_builtin_default_is_examples_default():
    builtin = default_deployment()
    example = load_deployment(EXAMPLES / "default.toml")
    assert attrs.evolve(builtin, source="") == attrs.evolve(example, source="")
    assert tomllib.loads((EXAMPLES / "default.toml").read_text()) == BASE


def test_scheduler_for_uses_memory_and_context():
    d = default_deployment()
    pool = d.pools[0]
    cfg = d.scheduler_for(pool)
    assert cfg.max_model_len == min(d.scheduler.max_model_len, d.model(pool.model).context_length)
    assert cfg.block_size == d.scheduler.block_size
    # more experts per GPU (smaller DEP) leaves fewer KV blocks per rank
    wider = attrs.evolve(pool, dep=16)
    assert d.kv_blocks_per_rank(wider) > d.kv_blocks_per_rank(pool)


def bad(mutate) -> str:
    data = copy.deepcopy(BASE)
    mutate(data)
    with pytest.raises(ConfigError) as e:
        deployment_from_dict(data, source="bad.toml")
    msg = str(e.value)
    assert "bad.toml" in msg
    return msg


def test_unknown_fields_are_named():
    assert "colour" in bad(lambda d: d.update(colour="red"))
    msg = bad(lambda d: d["scheduler"].update(max_num_seq=8))
    assert "max_num_seq" in msg and "[scheduler]" in msg and "max_num_seqs" in msg  # lists allowed
    assert "dpe" in bad(lambda d: d["pools"][0].update(dpe=8))
    assert "hbm" in bad(lambda d: d["hardware"].update(hbm=1))
    assert "layers" in bad(lambda d: d["models"][0].update(layers=3))
    assert "overlap" in bad(lambda d: d.update(cost={"overlap": 0.5}))


def test_bad_presets_are_named():
    msg = bad(lambda d: d["models"][0].update(preset="deepseek-v9"))
    assert "preset" in msg and "deepseek-v9" in msg and "deepseek-v3" in msg
    msg = bad(lambda d: d["hardware"].update(preset="h100"))
    assert "preset" in msg and "h100" in msg and "h200" in msg


def test_bad_role_is_named():
    msg = bad(lambda d: d["pools"][0].update(role="router"))
    assert "role" in msg and "router" in msg and "colocated" in msg


@pytest.mark.parametrize("field", ["dep", "instances"])
def test_dep_and_instances_must_be_positive(field):
    assert field in bad(lambda d: d["pools"][0].update({field: 0}))


def test_weights_that_do_not_fit():
    msg = bad(lambda d: d["pools"][0].update(dep=1))  # 671B FP8 on one H200
    assert "main" in msg and "deepseek-v3" in msg and "dep" in msg.lower() and "h200" in msg


def test_missing_sections_and_references():
    assert "models" in bad(lambda d: d.pop("models"))
    assert "pools" in bad(lambda d: d.pop("pools"))
    assert "models" in bad(lambda d: d.update(models={"preset": "tiny"}))
    msg = bad(lambda d: d["pools"][0].update(model="llama"))
    assert "llama" in msg and "model" in msg
    msg = bad(lambda d: d.update(models=[{"name": "custom", "num_layers": 4}]))
    assert "missing" in msg and "hidden_size" in msg


@pytest.mark.parametrize("field,value", [
    ("block_size", 15), ("max_num_seqs", 0), ("policy", "lifo"), ("max_num_batched_tokens", -1),
    ("max_kv_loads_per_step", -1),
])
def test_bad_scheduler_values_are_named(field, value):
    msg = bad(lambda d: d["scheduler"].update({field: value}))
    assert field in msg and "[scheduler]" in msg


def test_deployment_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_deployment(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[models]\npreset = 'tiny'\n")
    with pytest.raises(ConfigError, match="broken.toml.*not valid TOML"):
        load_deployment(broken)
    bad_field = tmp_path / "field.toml"
    bad_field.write_text(DEFAULT_DEPLOYMENT_TOML.replace("dep = 8", "dep = 8\nfoo = 1"))
    with pytest.raises(ConfigError, match=r"field\.toml.*\[\[pools\]\] #1.*foo"):
        load_deployment(bad_field)


def test_overrides_apply_over_presets():
    data = copy.deepcopy(BASE)
    data["models"][0]["context_length"] = 163840
    data["hardware"]["gpu_memory_utilization"] = 0.8
    d = deployment_from_dict(data)
    assert d.model("deepseek-v3").context_length == 163840
    assert d.model("deepseek-v3").num_layers == 61  # the rest from the preset
    assert d.kv_blocks_per_rank(d.pools[0]) < default_deployment().kv_blocks_per_rank(d.pools[0])


@pytest.mark.parametrize("where,field,value", [
    ("pools", "dep", "8"),
    ("pools", "dep", 8.0),
    ("models", "num_layers", "61"),
    ("hardware", "hbm_bytes", "141e9"),
])
def test_wrong_types_are_named(where, field, value):
    def mutate(d):
        table = d[where][0] if isinstance(d[where], list) else d[where]
        table[field] = value
    assert field in bad(mutate)


def test_engine_config_from_a_deployment_file():
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.config import ConfigError

    cfg = EngineConfig.from_deployment(load_deployment(EXAMPLES / "serve-tiny-cpu.toml"))
    assert (cfg.model, cfg.runtime, cfg.device, cfg.dtype) == ("tiny", "torch", "cpu", "float32")
    assert cfg.scheduler.num_blocks == 2048 and cfg.scheduler.host_cache_blocks == 0
    assert cfg.hash_secret == "change-me"
    dep2 = deployment_from_dict({"models": [{"preset": "tiny"}], "pools": [{"role": "colocated", "dep": 2}],
                                 "engine": {"device": "cpu", "num_blocks": 64}})
    assert EngineConfig.from_deployment(dep2).dep == 2
    with pytest.raises(ConfigError, match="engine.model must be a preset") as e:  # no checkpoint to run
        EngineConfig.from_deployment(load_deployment(EXAMPLES / "h200-dep8.toml"))
    assert "h200-dep8.toml" in str(e.value) and "give its [[models]] a checkpoint" in str(e.value)
    with pytest.raises(ConfigError, match=r"^x.toml: \[engine\]: dtype"):  # named by its file, where it is read
        deployment_from_dict({"models": [{"preset": "tiny"}], "pools": [{"role": "colocated"}],
                              "engine": {"device": "cpu", "dtype": "fp32"}}, source="x.toml")
    pd = EngineConfig.from_deployment(load_deployment(EXAMPLES / "serve-pd-cpu.toml"))
    assert (pd.prefill_instances, pd.instances, pd.kv_transport) == (1, 1, "nixl")
    two = load_deployment(EXAMPLES / "serve-two-models-cpu.toml")
    assert EngineConfig.from_deployment(two, model="tiny-draft").model == "tiny-draft"
    with pytest.raises(ConfigError, match="several models"):
        EngineConfig.from_deployment(two)
    with pytest.raises(ConfigError, match="no pool serves model 'big'"):
        EngineConfig.from_deployment(two, model="big")
    spec = deployment_from_dict({"models": [{"preset": "tiny"}, {"preset": "tiny-draft"}],
                                 "pools": [{"role": "colocated", "model": "tiny"}], "engine": {"device": "cpu"},
                                 "speculative": {"draft_model": "tiny-draft", "num_spec_tokens": 2,
                                                 "acceptance": "fixed", "rate": 0.5}})
    cfg = EngineConfig.from_deployment(spec, model="tiny")  # the draft the simulator prices, run for real
    assert (cfg.draft_model, cfg.num_spec_tokens, cfg.scheduler.num_spec_tokens) == ("tiny-draft", 2, 2)
    mixed = deployment_from_dict({"models": [{"preset": "tiny"}], "engine": {"device": "cpu"},
                                  "pools": [{"role": "colocated"}, {"role": "decode"}]})
    with pytest.raises(ConfigError, match="roles"):
        EngineConfig.from_deployment(mixed)


def test_eplb_table():
    from lockstep.policy.config import ConfigError

    d = deployment_from_dict({"models": [{"preset": "tiny"}], "pools": [{"role": "colocated", "dep": 2}],
                              "eplb": {"redundant_experts": 2, "window_steps": 8}})
    assert d.eplb.redundant_experts == 2 and d.eplb.window_steps == 8
    with pytest.raises(ConfigError, match=r"\[eplb\].*window_steps"):
        deployment_from_dict({"models": [{"preset": "tiny"}], "pools": [{"role": "colocated"}],
                              "eplb": {"window_steps": 0}})


@pytest.mark.parametrize("table, field, value", [
    ("models", "kv_bytes_per_token", 0),  # was a ZeroDivisionError
    ("models", "bytes_per_param", 0.0),
    ("models", "hidden_size", 0),
    ("hardware", "hbm_bandwidth", 1e-310),  # priced steps at infinity: the simulation never ended
    ("hardware", "flops", float("nan")),
    ("hardware", "gpu_memory_utilization", 2.0),
    ("cost", "a2a_overlap", 50.0),  # accepted, and gave a negative all-to-all time
    ("cost", "expert_balancedness", 0.0),
    ("host", "scheduler_s", -1.0),
])
def test_numbers_out_of_range_are_named(table, field, value):
    def mutate(d):
        target = d[table][0] if isinstance(d.get(table), list) else d.setdefault(table, {})
        target[field] = value
    msg = bad(mutate)
    assert field in msg and repr(value) in msg


def test_tables_of_the_wrong_kind_and_repeated_names_are_named():
    assert "cost must be a table" in bad(lambda d: d.update(cost=1))
    assert "hardware must be a table" in bad(lambda d: d.update(hardware="h200"))
    assert "pools must be an array of tables" in bad(lambda d: d.update(pools=["main"]))
    assert "names must be unique" in bad(lambda d: d["pools"].append(dict(d["pools"][0])))
    assert "names must be unique" in bad(lambda d: d["models"].append(dict(d["models"][0])))
    assert "seed must be an integer" in bad(lambda d: d.update(seed=1.7))
    assert "num_blocks is derived" in bad(lambda d: d["scheduler"].update(num_blocks=10))


def test_dep_must_divide_the_expert_slots():
    def skewed_dep6(d):
        d["pools"][0]["dep"] = 6
        d.setdefault("cost", {})["expert_skew"] = 1.0  # the simulator then places experts on the ranks
    msg = bad(skewed_dep6)
    assert "dep 6 must divide the expert slots" in msg and "[[pools]] #1" in msg
    msg = bad(lambda d: d["pools"][0].update(dep=6))  # a fixed balancedness too: EP shards experts evenly
    assert "dep 6 must divide the expert slots" in msg


def test_redundant_expert_slots_take_memory_from_the_kv_cache():
    """[eplb] redundant_experts: copies of experts, each rank holding its share (they took no
    memory, so 1,024 slots on an H200 DEP8 planned as if free)."""
    base = deployment_from_dict(copy.deepcopy(BASE))
    data = copy.deepcopy(BASE)
    data["eplb"] = {"redundant_experts": 32}
    spare = deployment_from_dict(data)
    pool, m = base.pools[0], base.model(base.pools[0].model)
    per_block = base.kv_bytes_per_token(pool) * base.scheduler.block_size
    lost = 32 / pool.dep * m.expert_bytes * m.moe_layers
    assert base.kv_blocks_per_rank(pool) - spare.kv_blocks_per_rank(pool) == pytest.approx(lost / per_block, abs=1)
    msg = bad(lambda d: d.update(eplb={"redundant_experts": 1024}))
    assert "1024 redundant expert slots" in msg and "fewer redundant slots" in msg


def test_a_host_tier_smaller_than_twice_the_gpu_cache_names_host_kv_bytes():
    msg = bad(lambda d: d["hardware"].update(host_kv_bytes=1e9))
    assert "[hardware] host_kv_bytes" in msg and "set it to 0 (no host tier) or at least" in msg


def test_async_scheduling_off_turns_the_host_overlap_off_and_a_contradiction_is_named():
    data = copy.deepcopy(BASE)
    data.setdefault("scheduler", {})["async_scheduling"] = False
    assert not deployment_from_dict(data).host.overlap
    assert deployment_from_dict(copy.deepcopy(BASE)).host.overlap
    msg = bad(lambda d: (d.setdefault("scheduler", {}).update(async_scheduling=False),
                         d.setdefault("host", {}).update(overlap=True)))
    assert "contradict" in msg and "[host] overlap" in msg


def test_sizes_that_would_only_exhaust_memory_are_refused():
    assert "[scheduler]: max_num_seqs must be an integer in [1, 65,536]" in bad(
        lambda d: d["scheduler"].update(max_num_seqs=10**11))
    assert "instances x dep must be at most 65,536 GPUs" in bad(lambda d: d["pools"][0].update(instances=10**5))
    def huge_blocks(d):  # (in range, but a dozen blocks fill the GPU)
        d["scheduler"].update(block_size=4096)
        d["models"][0].update(kv_bytes_per_token=10**6)
    msg = bad(huge_blocks)
    assert "a KV block of 4096 tokens takes" in msg and "lower [scheduler] block_size" in msg


def test_a_preset_reshaped_keeps_its_kv_per_layer_and_asks_for_its_dense_params():
    from lockstep.policy.deployment import MODEL_PRESETS

    base = MODEL_PRESETS[BASE["models"][0]["preset"]]
    msg = bad(lambda d: d["models"][0].update(num_layers=30))
    assert "num_layers change(s) preset" in msg and "give dense_params too" in msg
    data = copy.deepcopy(BASE)
    data["models"][0].update(num_layers=31, dense_params=base["dense_params"] / 2)
    m = deployment_from_dict(data, source="x.toml").models[0]
    assert m.kv_bytes_per_token == base["kv_bytes_per_token"] // base["num_layers"] * 31
    data["models"][0]["kv_bytes_per_token"] = 1000  # (given: kept)
    assert deployment_from_dict(data, source="x.toml").models[0].kv_bytes_per_token == 1000


def test_a_pool_names_its_model_when_there_are_several():
    def two(d):
        d["models"].append({"preset": "tiny"})
        del d["pools"][0]["model"]
    assert "name the pool's model (model = one of" in bad(two)


@pytest.mark.parametrize("field, value, says", [
    ("num_blocks", -5, "num_blocks must be an integer >= 0"),
    ("device", "tpu", "device must be 'cpu' or 'cuda[:N]'"),
    ("dtype", "int3", "dtype must be float32, float64, bfloat16 or float16"),
    ("kv_transport", "carrier-pigeon", "kv_transport must be 'nixl' or 'shm'"),
    ("kv_hold_timeout_s", -1, "kv_hold_timeout_s must be a finite number of seconds > 0"),
    ("kv_cache_dtype", "fp4", "kv_cache_dtype must be 'auto' or 'fp8'"),
    ("runtime", "", "runtime must name a runtime"),
])
def test_engine_values_are_checked_where_the_file_is_read(field, value, says):
    """The simulator ignores [engine], but one schema serves both: a file it takes, the server takes."""
    data = copy.deepcopy(BASE)
    data["engine"] = {field: value}
    with pytest.raises(ConfigError, match="^<dict>: \\[engine\\]: " + re.escape(says)):
        deployment_from_dict(data)
    data["engine"] = {"device": "cuda:1", "kv_transport": "shm", "kv_cache_dtype": "fp8", "num_blocks": 0}
    assert deployment_from_dict(data).engine.device == "cuda:1"


def test_a_file_without_hardware_says_so_and_a_bom_is_no_error(tmp_path):
    data = copy.deepcopy(BASE)
    assert deployment_from_dict(data).defaulted == ()
    del data["hardware"]
    dep = deployment_from_dict(data)
    assert dep.defaulted == ("hardware",) and dep.hardware.name == "h200"
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + DEFAULT_DEPLOYMENT_TOML.encode())
    assert load_deployment(path).hardware == default_deployment().hardware
