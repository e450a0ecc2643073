from pathlib import Path

import pytest

from core.catalog import catalog_entry, load_catalog
from core.catalog_file import with_model_appended
from core.env import ConfigError
from core.model_names import ModelName, is_valid_suffix, parse_model_name
from tests.processes import ROOT

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _catalog(tmp_path: Path, text: str):
    path = tmp_path / "models.toml"
    path.write_text(text)
    return load_catalog(path, data_dir=tmp_path / "data", default_lora_path="/srv/adapters")


def test_it_offers_the_shipped_base_model_with_its_lora_config():
    catalog = load_catalog(ROOT / "models.toml", data_dir=ROOT / "data", default_lora_path="/srv/adapters")
    model = catalog.get(SMOL)
    assert catalog.ids == [SMOL]
    assert model.weights == ROOT / "data" / "models" / SMOL
    assert model.lora.dynamic_lora_loading_path == "/srv/adapters"
    assert model.lora.max_num_adapters_per_replica >= 1 and model.lora.max_lora_rank >= 8
    assert catalog.get("gpt-4o") is None


def test_it_resolves_weights_under_the_data_folder_and_keeps_an_explicit_lora_path(tmp_path):
    catalog = _catalog(
        tmp_path,
        '[[models]]\nid = "a/b"\nweights = "models/b"\n'
        '[models.lora_config]\ndynamic_lora_loading_path = "s3://bucket/loras"\n',
    )
    model = catalog.get("a/b")
    assert model.weights == tmp_path / "data" / "models" / "b"
    assert model.lora.dynamic_lora_loading_path == "s3://bucket/loras"
    assert model.replicas == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[models]]\nid = "a"\nweights = "w"\n[models.lora_config]\nmax_lora_rank = "big"\n',
         r"models\[0\].lora_config.max_lora_rank must be a int, not 'big'"),
        ('[[models]]\nid = "a"\nweights = "w"\n[models.lora_config]\nmax_num_adapters_per_replica = 0\n',
         r"models\[0\].lora_config.max_num_adapters_per_replica must be at least 1"),
        ('[[models]]\nid = "a"\n', r"models\[0\]: 'weights' is missing"),
        ('[[models]]\nid = "a:b"\nweights = "w"\n', "must be non-empty and free of ':'"),
        ('[[models]]\nid = "a"\nweights = "w"\n[[models]]\nid = "a"\nweights = "v"\n', "lists a model id twice"),
        ("models = []\n", "lists no models"),
        ("[[models]\n", "models.toml: "),
    ],
)
def test_it_explains_what_is_wrong_with_a_catalog(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        _catalog(tmp_path, text)


def test_fine_tuned_names_split_at_the_last_colon():
    assert parse_model_name(f"{SMOL}:support-bot") == ModelName(SMOL, "support-bot")
    assert parse_model_name(SMOL) == ModelName(SMOL, None)
    assert str(ModelName(SMOL, "x1")) == f"{SMOL}:x1"


@pytest.mark.parametrize("suffix", ["a", "Support_Bot-2", "x" * 64])
def test_it_accepts_plain_suffixes(suffix):
    assert is_valid_suffix(suffix)


@pytest.mark.parametrize("suffix", ["", "x" * 65, "../etc", "a b", "a:b", "a/b", "é", "ok\n"])
def test_it_refuses_suffixes_that_could_escape_a_path_or_a_name(suffix):
    assert not is_valid_suffix(suffix)


def test_an_entry_written_from_a_model_reads_back_as_the_same_model(tmp_path):
    data_dir = ROOT / "data"
    shipped = load_catalog(ROOT / "models.toml", data_dir=data_dir, default_lora_path="/srv/adapters").require(SMOL)
    text = with_model_appended("", catalog_entry(shipped, data_dir, "/srv/adapters"))
    (tmp_path / "models.toml").write_text(text)
    assert load_catalog(tmp_path / "models.toml", data_dir, "/srv/adapters").models == (shipped,)
    assert 'dynamic_lora_loading_path = ""' in text  # the default path stays a default, not a copy of today's value
