"""Built-in adapters against their references, on tiny random-weight models built here (no downloads).

The embedding adapter must equal ``SentenceTransformer(path).encode``, the reranker
``CrossEncoder(path).predict``, the classifier a softmax over the model's logits; lengths come from
``tokenizer.json`` without torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.adapters import classifier, embedding, reranker
from carpool.errors import ConfigError, InvalidInput
from tests.tolerances import VECTOR_ATOL

WORDS = [
    *("the", "a", "cat", "dog", "sat", "on", "mat", "what", "is", "who", "where"),
    *("good", "bad", "hello", "world", "query", "passage", "long"),
]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "##ing"]
WINDOW = 64  # max_position_embeddings of the tiny models

TEXTS = ["the cat sat", "hello world", "what is a dog " * 3, "good", "the dogs sat on the mat " * 30]
PAIRS = [
    ["what is a cat", "the cat sat on the mat"],
    ["who is good", "hello world"],
    ["where", "the dog sat " * 40],
    ["the query " * 40, "a passage " * 40],
]


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    specials = {"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
    # transformers ships the tokenizer classes untyped.
    return PreTrainedTokenizerFast(tokenizer_object=tok, mask_token="[MASK]", **specials)  # type: ignore[no-untyped-call]


def tiny_config(**extra: Any) -> Any:
    from transformers import BertConfig

    # A wide initialisation so that outputs differ visibly between inputs.
    return BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=WINDOW,
        initializer_range=0.5,
        **extra,
    )


def save_classifier(path: Path, **extra: Any) -> Path:
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    BertForSequenceClassification(tiny_config(**extra)).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def reranker_dir(models_dir: Path) -> Path:
    return save_classifier(models_dir / "reranker", num_labels=1)


@pytest.fixture(scope="module")
def classifier_dir(models_dir: Path) -> Path:
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    return save_classifier(
        models_dir / "classifier", id2label=labels, label2id={v: k for k, v in labels.items()}
    )


@pytest.fixture(scope="module")
def embedding_dir(models_dir: Path) -> Path:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertModel

    torch.manual_seed(0)
    bert = models_dir / "bert"
    BertModel(tiny_config()).save_pretrained(bert)
    tiny_tokenizer().save_pretrained(bert)
    transformer = Transformer(str(bert), max_seq_length=48)
    pooling = Pooling(transformer.get_embedding_dimension(), "mean")
    model = SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")
    path = models_dir / "embedding"
    model.save(str(path))
    return path


def test_embedding_equals_sentence_transformers(embedding_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    adapter = embedding(embedding_dir, device="cpu")
    got = adapter(TEXTS)
    want = SentenceTransformer(str(embedding_dir), device="cpu").encode(TEXTS)
    assert isinstance(got, list) and all(isinstance(x, float) for x in got[0])
    assert np.allclose(np.array(got), want, atol=1e-5)
    assert not np.allclose(got[0], got[1], atol=1e-3)  # the model tells inputs apart
    assert adapter.max_length == 48  # the saved max_seq_length, not the position embeddings


def test_reranker_equals_cross_encoder_for_lists_and_dicts(reranker_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    adapter = reranker(reranker_dir, device="cpu")
    cross_encoder = CrossEncoder(str(reranker_dir), device="cpu")
    want = cross_encoder.predict(PAIRS)
    as_dicts = [{"query": q, "passage": p} for q, p in PAIRS]
    got = adapter(as_dicts)
    assert all(isinstance(score, float) for score in got)
    assert np.allclose(got, want, atol=1e-5) and np.allclose(adapter(PAIRS), want, atol=1e-5)
    assert not np.allclose(got[0], got[1], atol=1e-4)
    assert adapter.max_length == cross_encoder.max_seq_length == WINDOW


def test_reranker_applies_the_activation_saved_with_the_model(models_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    path = save_classifier(
        models_dir / "raw-reranker",
        num_labels=1,
        sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"},
    )
    want = CrossEncoder(str(path), device="cpu").predict(PAIRS)
    assert (want < 0).any() or (want > 1).any()  # raw logits, no sigmoid
    assert np.allclose(reranker(path, device="cpu")(PAIRS), want, atol=1e-5)


def test_classifier_labels_with_probabilities_from_id2label(classifier_dir: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    got = classifier(classifier_dir, device="cpu")(TEXTS)
    tokenizer = AutoTokenizer.from_pretrained(str(classifier_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(classifier_dir)).eval()
    with torch.inference_mode():
        for text, out in zip(TEXTS, got, strict=True):
            features = tokenizer(text, truncation=True, max_length=WINDOW, return_tensors="pt")
            probs = torch.softmax(model(**features).logits[0], dim=-1).tolist()
            assert list(out["scores"]) == ["negative", "neutral", "positive"]
            assert np.allclose(list(out["scores"].values()), probs, atol=VECTOR_ATOL)
            assert out["label"] == ["negative", "neutral", "positive"][int(np.argmax(probs))]


def test_classifier_takes_texts_and_pairs_in_one_batch(classifier_dir: Path) -> None:
    adapter = classifier(classifier_dir, device="cpu")
    items: list[Any] = ["the cat", ["the cat", "sat"], {"text": "a dog", "text_pair": "hello"}, "good"]
    alone = [adapter([item])[0] for item in items]
    together = adapter(items)
    for a, b in zip(alone, together, strict=True):
        assert a["label"] == b["label"]
        assert np.allclose(list(a["scores"].values()), list(b["scores"].values()), atol=VECTOR_ATOL)


def test_outputs_do_not_depend_on_the_batch(reranker_dir: Path) -> None:
    adapter = reranker(reranker_dir, device="cpu")
    alone = [adapter([pair])[0] for pair in PAIRS]
    assert np.allclose(adapter(PAIRS), alone, atol=VECTOR_ATOL)


def test_lengths_count_tokens_like_the_tokenizer_and_cap_at_the_window(
    reranker_dir: Path, embedding_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reranker_dir))
    rerank = reranker(reranker_dir)
    for query, passage in PAIRS:
        n = len(tokenizer(query, passage)["input_ids"])
        assert rerank.length([query, passage]) == min(n, WINDOW)
    assert rerank.length(PAIRS[3]) == WINDOW
    embed = embedding(embedding_dir)
    assert embed.lengths(TEXTS) == [min(len(tokenizer(t)["input_ids"]), 48) for t in TEXTS]
    assert embed.length("") == 2  # [CLS] [SEP]


def test_length_needs_no_torch_and_loads_nothing(
    reranker_dir: Path, embedding_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for heavy in ("torch", "transformers", "sentence_transformers"):
        monkeypatch.setitem(sys.modules, heavy, None)  # importing it now raises ImportError
    for adapter in (reranker(reranker_dir), embedding(embedding_dir), classifier(reranker_dir)):
        assert adapter.length(PAIRS[0] if adapter.kind == "reranker" else "the cat sat") > 2
        assert adapter.device is None
    chars = reranker(reranker_dir, length_by="chars")
    assert chars.length(["abcd", "abcdefgh"]) == 1 + 2 + 3
    assert chars.length(["x" * 1000, "y"]) == WINDOW


def test_a_missing_directory_is_refused_not_downloaded() -> None:
    adapter = embedding("sentence-transformers/all-MiniLM-L6-v2")  # building does no I/O
    with pytest.raises(ConfigError, match="local models only"):
        adapter.length("text")
    with pytest.raises(ConfigError, match="local models only"):
        adapter(["text"])


def test_a_coordinator_missing_the_model_stops_at_start_naming_the_path(
    tmp_path: Path, reranker_dir: Path
) -> None:
    # Unchecked, it started and failed every request with "length() raised ...; fix the item".
    from carpool.config import Settings
    from carpool.registry import BatchedSpec

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text('{"max_position_embeddings": 64}')
    for path, why in (
        (tmp_path / "absent", r"absent is not a directory"),
        (broken, r"broken/config\.json could not be read as JSON"),
        (no_tokenizer, r"no .*no-tokenizer/tokenizer\.json to count tokens with"),
    ):
        adapter = reranker(path)
        with pytest.raises(ConfigError, match=why):
            BatchedSpec("unit.rerank", adapter, adapter.length).warm_up(Settings())
        # A length of the task's own needs nothing of the model on the coordinator.
        BatchedSpec("unit.rerank", adapter, len).warm_up(Settings())
    good = reranker(reranker_dir)
    BatchedSpec("unit.rerank", good, good.length).warm_up(Settings())


def test_an_adapters_own_device_wins_over_the_workers(reranker_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("asks for CUDA where there is none")
    pinned = reranker(reranker_dir, device="cpu")  # kept off the GPU whatever CARPOOL_DEVICE says
    pinned.load("cuda")
    assert pinned.device == "cpu"
    wanting = reranker(reranker_dir, device="cuda")
    with pytest.raises(ConfigError, match=r"reranker\('.*'\)'s device=cuda but torch sees no CUDA"):
        wanting.load("cpu")
    worker_s = reranker(reranker_dir)  # "auto": the worker's device
    worker_s.load("cpu")
    assert worker_s.device == "cpu"


def test_the_workers_bf16_setting_reaches_the_adapters_and_only_cuda_batches_use_it(
    reranker_dir: Path, embedding_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CARPOOL_AUTOCAST_BF16`` was ignored by the adapters: their batches ran in fp32 on CUDA. The
    device here is CPU, so CUDA is stood in for by the device's name and torch.autocast is recorded
    (test_on_cuda_bf16_adapters_stay_near_fp32 checks the numbers where CUDA exists)."""
    import torch

    from carpool.config import Settings
    from carpool.gpu_worker import runner
    from carpool.registry import BatchedSpec

    bf16 = Settings(autocast_bf16=True)
    cases: list[tuple[Any, list[Any]]] = [(reranker, PAIRS), (embedding, TEXTS), (classifier, TEXTS)]
    for make, items in cases:
        path = embedding_dir if make is embedding else reranker_dir
        fp32 = make(path, device="cpu")
        want = fp32(items)
        on_cpu = make(path)
        BatchedSpec("unit.adapter", on_cpu, on_cpu.length).load("cpu", bf16)
        assert on_cpu.autocast_bf16 is False  # CPU batches stay fp32, as carpool.infer's do
        assert on_cpu(items) == want

    entered: list[tuple[str, Any]] = []
    real_autocast = torch.autocast

    def recorded(device_type: str, dtype: Any = None, **kwargs: Any) -> Any:
        entered.append((device_type, dtype))
        return real_autocast("cpu", dtype=torch.bfloat16, enabled=False)

    monkeypatch.setattr(torch, "autocast", recorded)
    # "cuda" as the device's name only: the model itself is built on the CPU.
    monkeypatch.setattr(runner, "pick_device", lambda setting, what="": setting)

    def built_on_cpu(adapter: Any) -> Any:
        build = adapter._build
        monkeypatch.setattr(adapter, "_build", lambda model_dir, _device: build(model_dir, "cpu"))
        return adapter

    for make, items in cases:
        path = embedding_dir if make is embedding else reranker_dir
        adapter = built_on_cpu(make(path))
        BatchedSpec("unit.adapter", adapter, adapter.length).load("cuda", bf16)
        assert adapter.autocast_bf16 is True
        adapter.device = "cpu"  # where the model is: the sequence models send their inputs there
        del entered[:]
        adapter(items)
        assert entered == [("cuda", torch.bfloat16)], f"{adapter.kind}: one forward under bf16 autocast"
        plain = built_on_cpu(make(path))
        BatchedSpec("unit.adapter", plain, plain.length).load("cuda", Settings())
        assert plain.autocast_bf16 is False


def test_a_function_of_ones_own_is_loaded_as_written_and_the_log_says_bf16_is_not_applied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from carpool.config import Settings
    from carpool.registry import BatchedSpec

    loads: list[tuple[Any, ...]] = []

    class Mine:
        def load(self, device: str) -> None:  # no autocast_bf16 parameter: it is never passed one
            loads.append((device,))

        def __call__(self, items: list[Any]) -> list[Any]:
            return items

    spec = BatchedSpec("unit.mine", Mine(), len)
    with caplog.at_level("INFO", logger="carpool.registry"):
        spec.load("cpu", Settings())
        assert "AUTOCAST" not in caplog.text
        spec.load("cpu", Settings(autocast_bf16=True))
    assert loads == [("cpu",), ("cpu",)]
    assert "unit.mine: CARPOOL_AUTOCAST_BF16 applies to carpool's models and adapters" in caplog.text


@pytest.mark.parametrize(
    ("kind", "item", "message"),
    [
        ("reranker", "just a string", "takes \\[query, passage\\]"),
        ("reranker", ["only one"], "takes \\[query, passage\\]"),
        ("reranker", {"query": "q"}, "a dict with keys 'query' and 'passage'"),
        ("reranker", ["q", 3], "a list of two strings"),
        ("embedding", 42, "takes a string, got int"),
        ("classifier", None, "takes \\[text, text_pair\\]"),
    ],
)
def test_items_of_the_wrong_shape_are_invalid_input(
    kind: str, item: Any, message: str, reranker_dir: Path, embedding_dir: Path
) -> None:
    adapter = {
        "reranker": reranker(reranker_dir),
        "embedding": embedding(embedding_dir),
        "classifier": classifier(reranker_dir),
    }[kind]
    with pytest.raises(InvalidInput, match=message):
        adapter.length(item)
    with pytest.raises(InvalidInput, match=message):
        adapter([item])
    assert adapter.device is None  # refused before loading anything


def test_load_is_lazy_and_happens_once(reranker_dir: Path) -> None:
    adapter = reranker(reranker_dir, device="cpu")
    assert adapter([]) == [] and adapter.device is None
    adapter.load()
    model = adapter._model
    adapter(PAIRS[:1])
    adapter.load("cuda")  # already loaded: a second load changes nothing
    assert adapter._model is model and adapter.device == "cpu"


@pytest.mark.slow
def test_embedding_of_the_packaged_minilm_equals_sentence_transformers() -> None:
    from sentence_transformers import SentenceTransformer

    from carpool.models.minilm import MiniLM, model_dir

    texts = ["A man is eating food.", "word " * 400, "Ein Satz auf Deutsch", "short"]
    adapter = embedding(model_dir(), device="cpu")
    want = SentenceTransformer(str(model_dir()), device="cpu").encode(texts)
    assert np.allclose(np.array(adapter(texts)), want, atol=1e-5)
    assert adapter.max_length == MiniLM().max_length == 256
    assert adapter.lengths(texts) == [len(ids) for ids in MiniLM().encode(texts)]


@pytest.mark.gpu
def test_on_cuda_the_adapters_agree_with_cpu(reranker_dir: Path, embedding_dir: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cases: list[tuple[Any, Any, list[Any]]] = [
        (reranker(reranker_dir), reranker(reranker_dir, device="cpu"), PAIRS),
        (embedding(embedding_dir), embedding(embedding_dir, device="cpu"), TEXTS),
    ]
    for on_gpu, on_cpu, items in cases:  # the default device, "auto", picks CUDA when present
        got = on_gpu(items)
        assert on_gpu.device == "cuda"
        assert np.allclose(got, on_cpu(items), atol=1e-4)


@pytest.mark.gpu
def test_on_cuda_bf16_adapters_stay_near_fp32(reranker_dir: Path, embedding_dir: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for make, path, items in ((reranker, reranker_dir, PAIRS), (embedding, embedding_dir, TEXTS)):
        fp32, bf16 = make(path), make(path)
        fp32.load("cuda")
        bf16.load("cuda", autocast_bf16=True)
        want, got = np.array(fp32(items)), np.array(bf16(items))
        assert got.dtype == np.float64 and got.shape == want.shape  # Python floats, as in fp32
        assert not np.array_equal(got, want), f"{fp32.kind}: bf16 changed nothing; autocast not applied"
        assert np.allclose(got, want, atol=5e-2)
