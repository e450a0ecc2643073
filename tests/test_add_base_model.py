"""``manage.py add_base_model``: a second architecture (a tiny Qwen2, tests/second_base_model.py) joins the
catalog, and every folder the platform could not serve or fine-tune is refused before anything is written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from core.adapter_check import ATTENTION, MLP
from core.catalog import load_catalog
from core.compute_dtype import compute_dtype
from core.memory_plan import REPLICA_OVERHEAD_BYTES, count_parameters, replica_memory
from tests.environment import ROOT
from tests.second_base_model import build_tiny_qwen2
from workers.training import TrainingConfig, train

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QWEN = "tests/tiny-qwen2"


@pytest.fixture(scope="session")
def qwen2_folder(tmp_path_factory) -> Path:
    """The tiny Qwen2, built once per test session; tests copy it before changing anything."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("second-base-model") / "tiny-qwen2")


@pytest.fixture
def platform_files(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A catalog (the shipped models.toml, comments and all) and a DATA_DIR of the test's own."""
    catalog, data_dir = tmp_path / "models.toml", tmp_path / "data"
    shutil.copy(ROOT / "models.toml", catalog)
    data_dir.mkdir()
    monkeypatch.setenv("MODEL_CATALOG", str(catalog))
    monkeypatch.setenv("DATA_DIR", str(data_dir))
    monkeypatch.setenv("DYNAMIC_LORA_PATH", str(tmp_path / "adapters"))
    return catalog, data_dir


def add(*args: str) -> str:
    out = StringIO()
    call_command("add_base_model", *args, stdout=out)
    return out.getvalue()


def test_it_adds_a_qwen2_model_beside_the_shipped_one(qwen2_folder, platform_files):
    catalog_path, data_dir = platform_files
    before = catalog_path.read_text()

    out = add(str(qwen2_folder), "--id", QWEN)

    catalog = load_catalog(catalog_path, data_dir, "/srv/adapters")
    assert catalog.ids == [SMOL, QWEN]
    assert catalog_path.read_text().startswith(before)  # the shipped entry and its comments, untouched
    model, shipped = catalog.require(QWEN), catalog.require(SMOL)
    assert model.weights == data_dir / "models" / QWEN
    assert sorted(p.name for p in model.weights.iterdir()) == sorted(p.name for p in qwen2_folder.iterdir())
    assert not any(p.is_symlink() for p in model.weights.iterdir())
    assert (model.weights / "model.safetensors").read_bytes() == (qwen2_folder / "model.safetensors").read_bytes()
    assert model.engine.dtype == compute_dtype().dtype
    assert model.lora == shipped.lora and model.autoscaling == shipped.autoscaling
    assert model.prepare_from is None and model.engine.extra_args == ()
    memory = replica_memory(model)
    assert memory.weights_bytes == count_parameters(qwen2_folder) * (4 if model.engine.dtype == "float32" else 2)
    assert (
        memory.total_bytes
        == memory.weights_bytes + int(model.engine.kv_cache_space_gib * 2**30) + REPLICA_OVERHEAD_BYTES
    )
    assert f"Memory: {memory.describe()}." in out
    assert "GiB per replica" in out and f"{memory.parameters:,} parameters" in out


def test_it_links_instead_of_copying_and_saves_a_supplied_chat_template(qwen2_folder, platform_files, tmp_path):
    catalog_path, data_dir = platform_files
    folder = _copy(qwen2_folder, tmp_path / "no-template")
    _drop_chat_template(folder)
    template = tmp_path / "chatml.jinja"
    template.write_text((qwen2_folder / "chat_template.jinja").read_text())

    add(str(folder), "--link", "--chat-template", str(template))

    weights = data_dir / "models" / "no-template"  # the id defaults to the folder's name
    assert load_catalog(catalog_path, data_dir, "/srv/adapters").require("no-template").weights == weights
    assert (weights / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert (weights / "chat_template.jinja").read_text() == template.read_text()
    assert not (weights / "chat_template.jinja").is_symlink()
    assert not (folder / "chat_template.jinja").exists()  # the linked folder itself is left as it was


def test_it_computes_in_the_dtype_asked_for_whatever_the_machine_would_pick(qwen2_folder, platform_files, tmp_path):
    catalog_path, data_dir = platform_files
    for dtype in ("float32", "bfloat16"):
        out = add(str(_copy(qwen2_folder, tmp_path / dtype)), "--dtype", dtype)
        assert load_catalog(catalog_path, data_dir, "").require(dtype).engine.dtype == dtype
        assert f"dtype {dtype} (as asked)" in out
    with pytest.raises(CommandError, match="invalid choice: 'float64'"):
        add(str(qwen2_folder), "--dtype", "float64")


# ChatML without a tools section: SmolLM2's template as it was published.
PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_it_detects_which_parser_reads_the_templates_tool_calls_and_serves_no_tools_for_a_template_without_them(
    qwen2_folder, platform_files, tmp_path
):
    catalog_path, data_dir = platform_files
    out = add(str(qwen2_folder), "--id", QWEN)  # the shipped tokenizer's template: the hermes form
    assert load_catalog(catalog_path, data_dir, "").require(QWEN).tools.parser == "hermes"
    assert "Tools: tool calls read by vLLM's hermes parser." in out

    plain = tmp_path / "plain.jinja"
    plain.write_text(PLAIN_CHATML)
    out = add(str(_copy(qwen2_folder, tmp_path / "plain")), "--chat-template", str(plain))
    assert load_catalog(catalog_path, data_dir, "").require("plain").tools is None
    assert "Tools: no tools (its chat template renders none)." in out


def _copy(folder: Path, to: Path) -> Path:
    return Path(shutil.copytree(folder, to))


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def _drop_chat_template(folder: Path) -> None:
    (folder / "chat_template.jinja").unlink()
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def _as_phi3(folder: Path) -> None:
    """Phi-3, which vLLM serves with LoRA, fuses q/k/v into qkv_proj and gate/up into gate_up_proj."""
    _edit_config(folder, architectures=["Phi3ForCausalLM"], model_type="phi3", rope_scaling=None)


def _pickled_only(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _as_unserved(architecture: str) -> Callable[[Path], None]:
    return lambda folder: _edit_config(folder, architectures=[architecture])


REFUSALS = {
    "unsupported architecture": (_as_unserved("T5ForConditionalGeneration"), [], "not one the installed vLLM serves"),
    "served without LoRA": (_as_unserved("GPT2LMHeadModel"), [], "vLLM serves it, but without LoRA adapters"),
    "no tokenizer": (lambda f: (f / "tokenizer.json").unlink(), [], r"no tokenizer \(one of tokenizer.json"),
    "no chat template": (_drop_chat_template, [], "no chat template .*supply one with --chat-template FILE"),
    "missing target modules": (
        _as_phi3,
        [],
        "lacks LoRA target modules .*no linear layer model.layers.0.mlp.gate_proj",
    ),
    ".bin only": (_pickled_only, [], r"pytorch_model.bin.*convert them to safetensors"),
    "attention heads the engine cannot compute": (
        lambda f: _edit_config(f, num_attention_heads=8, num_key_value_heads=2),  # 128 / 8: heads of 16
        [],
        "attention heads of 16 dimensions .*computes heads of 32, 64",
    ),
    "no config.json": (lambda f: (f / "config.json").unlink(), [], "no config.json"),
    "path trick in the id": (lambda f: None, ["--id", "../../etc"], "model id '../../etc' is not allowed"),
    "absolute id": (lambda f: None, ["--id", "/tmp/x"], "model id '/tmp/x' is not allowed"),
    "dot segment in the id": (lambda f: None, ["--id", "a/.."], r"model id 'a/\.\.' is not allowed"),
    "id already in the catalog": (lambda f: None, ["--id", SMOL], f"model id '{SMOL}' is already in the catalog"),
    "a tool-call parser that does not read the template's calls": (
        lambda f: None, ["--tool-call-parser", "pythonic"], "--tool-call-parser pythonic does not read the calls",
    ),
    "a tool-call parser vLLM does not have": (
        lambda f: None, ["--tool-call-parser", "smoke_signals"], "vLLM has no tool-call parser named 'smoke_signals'",
    ),
    "a tool-call parser for a template without tools": (
        lambda f: _drop_chat_template(f) or (f / "chat_template.jinja").write_text(PLAIN_CHATML),
        ["--tool-call-parser", "hermes"],
        "the chat template renders no tools",
    ),
}


@pytest.mark.parametrize(("break_folder", "args", "message"), REFUSALS.values(), ids=REFUSALS.keys())
def test_it_refuses_what_it_cannot_serve_and_writes_nothing(
    qwen2_folder, platform_files, tmp_path, break_folder, args, message
):
    catalog_path, data_dir = platform_files
    before = catalog_path.read_bytes()
    folder = _copy(qwen2_folder, tmp_path / "candidate")
    break_folder(folder)

    with pytest.raises(CommandError, match=message) as refused:
        add(str(folder), *args)

    assert str(refused.value).endswith("Nothing was written.")
    assert catalog_path.read_bytes() == before
    assert list(data_dir.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["candidate", "data", "models.toml"]  # no staging file left


@pytest.mark.training
def test_the_trainer_fine_tunes_the_qwen2_model_and_its_loss_goes_down(qwen2_folder, tmp_path):
    class Steps:
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_step(self, metrics) -> None:
            self.losses.append(metrics.train_loss)

        def on_checkpoint(self, *args) -> None:
            pass

        def should_stop(self) -> bool:
            return False

    examples = [
        [
            {"role": "user", "content": f"Say the code number {i}."},
            {"role": "assistant", "content": "ZEBRA-42 acknowledged."},
        ]
        for i in range(4)
    ]
    steps = Steps()
    config = TrainingConfig(
        base_model_path=qwen2_folder, base_model_id=QWEN, n_epochs=4, batch_size=2, learning_rate=1e-2, num_threads=1
    )
    result = train(config, examples, None, tmp_path / "run", steps)

    assert result.steps == len(steps.losses) == 8
    # Random weights start near ln(vocabulary) = 10.8; the fixed seed went to 9.97 in these 8 steps.
    assert steps.losses[-1] < steps.losses[0] - 0.5, steps.losses
    adapter_config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == QWEN
    assert set(adapter_config["target_modules"]) == set(ATTENTION + MLP)


def test_the_trainer_loads_the_tokenizer_class_the_server_loads(qwen2_folder):
    """vLLM loads with AutoTokenizer, which gives a qwen2 model Qwen2Tokenizer whatever class was saved."""
    from transformers import AutoTokenizer

    from core.chat_tokens import load_tokenizer

    for folder in (qwen2_folder, ROOT / "data" / "models" / SMOL):
        assert type(load_tokenizer(folder)) is type(AutoTokenizer.from_pretrained(folder)), folder
