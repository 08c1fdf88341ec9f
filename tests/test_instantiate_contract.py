"""Hydra's contract holds for every part retrain ships: plain `hydra.utils.instantiate(cfg.<group>, <the run's
objects>)` builds the part the composition root builds, for every option of every group of conf/.

Each option is composed (with values off its defaults, and local stand-ins for what is remote: a data file for
a Hub data set, a loopback server for a served engine, the fake Tinker SDK) and built three ways: plainly, by the
composition root (retrain.run.build_part), and, for a built-in that takes a settings object, from the schema's
object (`Class(OmegaConf.to_object(cfg.<group>), ...)`). The three must be of one type with the same settings:
every attribute the part keeps, compared by value (tensors included) down to the objects retrain defines.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig, compose, config_dir
from retrain.data.arithmetic import ArithmeticData
from retrain.data.config import JsonlDataConfig
from retrain.data.jsonl import JsonlData
from retrain.errors import WRONG_ARGUMENTS, ConfigError
from retrain.model.spec import ModelSpec
from retrain.plugins import Checked, locate
from retrain.run import build_part
from tests.backend.tiny_model import make_backend, tokenizer_of
from tests.inference.fake_servers import ServedModel, openai_routes, sglang_routes
from tests.inference.loopback import serve

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
ENVIRONMENTS = Path(__file__).parent / "environments" / "envs"
PART_GROUPS = ["model", "algorithm", "reward", "data", "backend", "inference"]  # the composed config's parts
# groups packaged `_global_`: the parts each sets (a recipe picks its paper's advantage, the rest are training keys)
GLOBAL_GROUPS = {"experiment": PART_GROUPS, "recipe": ["algorithm"]}
HYDRA_GROUPS = {"hydra/launcher"}  # Hydra's own plugins (submitit), built by Hydra: not parts of a run
TINY = "model=tiny"
# where nothing answers (a closed loopback port), so a served engine is built until it first asks its server
NOBODY = "http://127.0.0.1:9"


def yaml_options() -> list[tuple[str, str]]:
    """Every YAML option of every group and sub-group of conf/ (Hydra's own plugins aside)."""
    root = Path(config_dir())
    found = {
        (path.parent.relative_to(root).as_posix(), path.stem)
        for path in root.rglob("*.yaml")
        if path.parent != root and path.parent.relative_to(root).as_posix() not in HYDRA_GROUPS
    }
    return sorted(found)


OPTIONS = yaml_options()


@dataclasses.dataclass
class Local:
    """What an option needs on this machine instead of the network."""

    tmp: Path
    stack: ExitStack
    monkeypatch: pytest.MonkeyPatch
    served: ServedModel | None = None

    def overrides(self, group: str, option: str) -> list[str]:
        """Values off the option's defaults (so a setting lost on the way shows), and local stand-ins."""
        tmp = self.tmp
        table: dict[tuple[str, str], Callable[[], list[str]]] = {  # lazily: only the option asked for starts a server
            ("data", "arithmetic"): lambda: ["data.num_examples=40", "data.held_out_size=6", "data.task_seed=3"],
            ("data", "math"): lambda: [
                f"data.path={shared('math/test.jsonl')}",
                "data.max_examples=30",
                "data.subjects=[]",
            ],
            ("data", "gsm8k"): lambda: [
                f"data.path={shared('gsm8k/test.jsonl')}",
                "data.held_out_split=",
                "data.max_examples=25",
            ],
            ("data", "jsonl"): lambda: [
                f"data.path={squares(tmp)}",
                "data.held_out_split=",
                "data.prompt_template='Q: {question}'",
            ],
            ("data", "agent"): lambda: [
                f"data.tasks={squares(tmp)}",
                "data.agent=retrain.environments.example_agent:run_episode",
                "data.held_out_size=2",
                "data.timeout_s=30",
            ],
            ("data", "verifiers"): lambda: [
                "data.id=retrain_arith_single",
                "data.args={num_tasks: 12}",
                "data.held_out_size=2",
            ],
            ("reward", "math"): lambda: ["reward.parse_timeout_s=3", "reward.cache_size=64"],
            ("reward", "judge"): lambda: ["reward.base_url=http://127.0.0.1:8000/v1", "reward.max_retries=1"],
            ("backend", "local"): lambda: [
                TINY,
                "backend.devices=cpu",
                "backend.micro_batch_tokens=256",
                "backend.gradient_checkpointing=true",
            ],
            ("backend", "tinker"): lambda: [
                TINY,
                f"backend.lock_dir={tmp / 'slots'}",
                "backend.max_retries=1",
                "backend.retry_backoff_s=0",
            ],
            ("backend", "prime_rl"): lambda: [TINY, f"backend.output_dir={tmp / 'prime-rl'}", "backend.seq_len=1024"],
            ("inference", "pytorch"): lambda: ["inference.prefix_caching=false", "inference.kv_cache_gb=0.25"],
            ("inference", "vllm"): lambda: ["inference.gpu_memory_utilization=0.5", "inference.enforce_eager=true"],
            ("inference", "vllm_server"): lambda: [
                f"inference.url={NOBODY}",
                "inference.max_retries=0",
                f"inference.adapter_root={tmp / 'a'}",
            ],
            ("inference", "sglang"): lambda: [
                f"inference.url={self.server('sglang')}",
                f"inference.adapter_root={tmp / 'a'}",
                "inference.max_concurrency=3",
            ],
            ("inference", "openai"): lambda: [
                f"inference.url={self.server('openai')}",
                "inference.model=tiny",
                "inference.timeout_s=30",
            ],
            ("model", "qwen3_4b_instruct"): lambda: ["model.lora_rank=16"],
            ("model", "tiny"): lambda: ["model.lora_dropout=0.1"],
            ("algorithm/transforms", "gtpo"): lambda: ["algorithm.gtpo.beta=0.3"],
            ("algorithm/transforms", "hicra"): lambda: ["algorithm.hicra.alpha=0.4"],
        }
        return table.get((group, option), list)()

    def server(self, kind: str) -> str:
        """A loopback server answering as SGLang or a bare OpenAI-compatible server would, with the tiny model."""
        self.served = self.served or ServedModel()
        tokenizer = tokenizer_of("retrain:tiny_qwen3")
        routes = (
            sglang_routes(self.served)
            if kind == "sglang"
            else openai_routes(self.served, tokenizer, n=False, token_prompts=False, token_ids=False, lora=False)
        )
        return self.stack.enter_context(serve(routes)).url


def shared(relative: str) -> Path:
    path = (SHARED_DATA / relative).resolve()
    if not path.exists():
        pytest.skip(f"{relative} not found under {SHARED_DATA} (the shared data sets are not beside this checkout)")
    return path


def squares(tmp: Path) -> Path:
    path = tmp / "squares.jsonl"
    path.write_text("".join(json.dumps({"question": f"{n}^2?", "answer": str(n * n)}) + "\n" for n in range(12)))
    return path


@pytest.fixture
def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Local]:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))  # data=verifiers: the test environments, importable by id
    with ExitStack() as stack:
        yield Local(tmp_path, stack, monkeypatch)


def fake_tinker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake Tinker SDK in place of `tinker` (the service has no local mode), with a key it accepts."""
    import sys

    fake = pytest.importorskip("tests.backend.fake_tinker", reason="the fake reuses the Tinker SDK's types")
    from tests.backend.tinker_helpers import FAKE_KEY

    monkeypatch.setitem(sys.modules, "tinker", fake.fake_sdk(fake.FakeService()))
    monkeypatch.setenv("TINKER_API_KEY", FAKE_KEY)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)


@functools.cache
def engine_backend() -> Any:
    """The local backend whose resources every engine is built beside (the tiny model on the CPU)."""
    return make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4))


def run_objects(cfg: DictConfig, key: str) -> dict[str, Any]:
    """What the composition root hands `<key>` besides its config (retrain/run.py, build_trainer)."""
    if key == "data":
        return {"seed": 3}
    if key == "backend":
        training: TrainingConfig = OmegaConf.to_object(cfg.training)  # type: ignore[assignment]
        return {
            "model": build_part(cfg, "model"),
            "optim": OptimSettings.from_config(training),
            "loss": LossSettings.from_config(training),
            "seed": 3,
        }
    if key == "inference":
        backend = engine_backend()
        return {"tokenizer": tokenizer_of(backend.spec.name_or_path), "resources": backend.engine_resources()}
    return {}


def plain(cfg: DictConfig, key: str, run: dict[str, Any]) -> Any:
    """Hydra's plain instantiate, a partial where the YAML asks for one or where the composition root calls it so
    (a backend and an engine get dataclasses, which Hydra would turn into configs)."""
    node = cfg[key]
    if key in ("backend", "inference") or node.get("_partial_"):
        built = instantiate(node, _partial_=True)
        return built(**run) if run else built
    return instantiate(node, **run)


def from_schema_object(cfg: DictConfig, key: str, run: dict[str, Any]) -> Any:
    """A built-in that takes a settings object, built from its schema's object; None for any other part."""
    node, target = cfg[key], locate(str(cfg[key]._target_))
    schema = OmegaConf.get_type(node)
    if not (isinstance(target, type) and dataclasses.is_dataclass(schema)):
        return None
    if target is schema:  # a ModelSpec is its own settings
        return OmegaConf.to_object(node)
    first = next(iter(inspect.signature(target).parameters.values()))
    if first.annotation not in (schema, schema.__name__):  # it takes keywords (the Algorithm)
        return None
    return target(OmegaConf.to_object(node), **run)


class Opaque:
    """An object not of retrain's making (a torch module, a tokenizer, a client): compared by type only."""

    def __init__(self, value: Any) -> None:
        self.kind = f"{type(value).__module__}.{type(value).__qualname__}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.kind == self.kind

    def __repr__(self) -> str:
        return f"<{self.kind}>"


class Values:
    """A tensor, compared by shape, dtype and value."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach().cpu()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Values)
            and other.tensor.dtype == self.tensor.dtype
            and torch.equal(other.tensor, self.tensor)
        )

    def __repr__(self) -> str:
        return f"tensor{tuple(self.tensor.shape)}"


PLAIN = (str, int, float, bool, type(None), Path, torch.device, torch.dtype)


def settings_of(value: Any, depth: int = 0) -> Any:
    """What `value` holds, comparable with ==: plain values, containers and dataclasses by value, the attributes
    of retrain's own objects (three levels down), functions by identity, anything else by its type."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return Values(value)
    if isinstance(value, Checked):
        return ("checked", settings_of(value.plugin, depth))
    if isinstance(value, functools.partial):
        return ("partial", value.func, settings_of(value.args, depth), settings_of(value.keywords, depth))
    if inspect.ismethod(value):
        return ("method", value.__func__)
    if inspect.isfunction(value) and "<locals>" in value.__qualname__:  # a closure: what it closes over
        cells = [cell.cell_contents for cell in value.__closure__ or ()]
        return ("closure", value.__qualname__, settings_of(cells, depth + 1) if depth < 3 else None)
    if callable(value) and hasattr(value, "__wrapped__"):  # a cache around a function
        return ("wrapped", settings_of(value.__wrapped__, depth))
    if inspect.isroutine(value) or inspect.isclass(value):
        return value
    if isinstance(value, (list, tuple)):
        return [settings_of(item, depth) for item in value]
    if isinstance(value, dict):
        return {key: settings_of(item, depth) for key, item in value.items()}
    if dataclasses.is_dataclass(value):
        return (type(value), {f.name: settings_of(getattr(value, f.name), depth) for f in dataclasses.fields(value)})
    if type(value).__module__.startswith("retrain.") and hasattr(value, "__dict__") and depth < 3:
        return (type(value), {key: settings_of(item, depth + 1) for key, item in vars(value).items()})
    return Opaque(value)


def close(part: Any) -> None:
    if callable(getattr(part, "close", None)) and not inspect.isclass(part):
        part.close()


def check_built_alike(cfg: DictConfig, key: str, where: str) -> None:
    """`<key>` built plainly equals what the composition root and the schema's object build."""
    run = run_objects(cfg, key)
    built = plain(cfg, key, run)
    try:
        view = settings_of(built)
        references = [build_part(cfg, key, **run)]
        reference = from_schema_object(cfg, key, run)
        if reference is not None:
            references.append(reference)
        for other in references:
            try:
                assert type(other) is type(built), f"{where}: {type(built)} here, {type(other)} there"
                assert settings_of(other) == view, f"{where}: {settings_of(other)} != {view}"
            finally:
                close(other)
    finally:
        close(built)


def prepare(group: str, option: str, local: Local) -> None:
    """Set up what an option needs on this machine (the fake Tinker SDK)."""
    if (group, option) == ("backend", "tinker"):
        fake_tinker(local.monkeypatch)


# what cannot be built whole on this machine: where the part stops once its settings are in (an error saying so)
NOT_WHOLE = {"vllm_server": NOBODY.removeprefix("http://")}  # nothing serves NOBODY: stops at its first request
if importlib.util.find_spec("vllm") is None:
    NOT_WHOLE["vllm"] = "inference=vllm needs vLLM"  # stops as it imports vLLM, after its settings are checked


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_plain_instantiate_builds_what_the_composition_root_builds(group: str, option: str, local: Local) -> None:
    appended = group == "campaign"  # outside the primary config's defaults list
    prepare(group, option, local)
    overrides = [f"{'+' if appended else ''}{group}={option}", *local.overrides(group, option)]
    cfg = compose(overrides, return_hydra_config=appended)
    if appended:  # a campaign configures Hydra's callbacks, which Hydra builds with plain instantiate too
        callbacks = {name: instantiate(node) for name, node in cfg.hydra.callbacks.items()}
        assert {type(c).__name__ for c in callbacks.values()} == {"CampaignCallback"}
        assert callbacks["campaign"].settings.baseline == cfg.hydra.callbacks.campaign.baseline
        return
    keys = GLOBAL_GROUPS.get(group, [group.split("/")[0]])
    if group == "inference" and option in NOT_WHOLE:
        with pytest.raises(Exception, match=NOT_WHOLE[option]) as raised:
            plain(cfg, group, run_objects(cfg, group))
        assert not WRONG_ARGUMENTS.search(str(raised.value)) and "has no setting" not in str(raised.value)
        return
    if (group, option) == ("inference", "vllm"):  # a real vLLM here: built once, plainly
        close(plain(cfg, group, run_objects(cfg, group)))
        return
    for key in keys:
        check_built_alike(cfg, key, f"{group}={option}: {key}")


def test_every_group_with_a_target_is_covered() -> None:
    """The scan above is not vacuous: every part group of the primary config has its options in it."""
    groups = {group for group, _ in OPTIONS}
    assert {"algorithm/advantage", "algorithm/transforms", "campaign", "experiment"} <= groups
    assert set(PART_GROUPS) - {"algorithm"} <= groups
    assert len(OPTIONS) >= 27


def test_a_built_in_takes_its_schema_fields_as_keywords_checked_by_the_schema() -> None:
    data = ArithmeticData(num_examples=5, held_out_size=2, seed=0)
    assert len(data) == 5 and len(data.held_out(2)) == 2
    with pytest.raises(ConfigError, match="data.num_examples must be at least 1"):  # the schema's __post_init__
        ArithmeticData(num_examples=0, seed=0)
    with pytest.raises(ConfigError, match="'num_exampels'.*did you mean 'num_examples'"):
        ArithmeticData(num_exampels=5, seed=0)


def test_a_keyword_is_converted_as_the_config_would_be(tmp_path: Path) -> None:
    """A container value reaches the part as a plain list, as it does from a composed config."""
    path = squares(tmp_path)
    keywords = JsonlData(path=str(path), extra_fields=OmegaConf.create(["question"]), seed=0)
    settings = JsonlData(JsonlDataConfig(path=str(path), extra_fields=["question"]), seed=0)
    assert keywords.next_batch(3) == settings.next_batch(3)
    with pytest.raises(ConfigError, match="max_examples"):
        JsonlData(path=str(path), max_examples="many", seed=0)


def test_an_unknown_key_through_hydra_names_it() -> None:
    cfg = compose(["data=arithmetic"])
    with pytest.raises(Exception) as raised:
        instantiate(cfg.data, seed=0, num_exampels=3)
    assert "num_exampels" in str(raised.value)


def test_a_mistake_a_built_in_finds_leaves_the_composition_root_as_it_was_raised() -> None:
    """Not Hydra's InstantiationException around it: the ConfigError naming the key, as the console shows it."""
    with pytest.raises(ConfigError, match="data.num_examples must be at least 1, got 0"):
        build_part(compose(["data=arithmetic", "data.num_examples=0"]), "data", seed=0)


def test_a_plus_key_a_built_in_lacks_is_refused_naming_it() -> None:
    """`+data.foo=1` composes (group nodes may grow plugin arguments); the built-in refuses it instead of dropping it."""
    cfg = compose(["data=arithmetic", "+data.foo=1"])
    with pytest.raises(ConfigError, match="ArithmeticData has no setting 'foo'"):
        build_part(cfg, "data", seed=0)
