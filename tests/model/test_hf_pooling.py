"""Pooling models from Hugging Face folders, against transformers on tiny random models (float32; no hub access):
  - embeddings: a Qwen3-Embedding-shaped folder (transformers' `Qwen3Model`, saved as embedding models are: no LM
    head of its own, tied embeddings, no `model.` prefix) with sentence-transformers' modules (last-token pooling,
    Normalize): `LLMEngine.embed`'s vectors equal the last hidden states pooled the same way (cosine > 0.99999 and
    1e-5 relative);
  - classification: a `Qwen3ForSequenceClassification` folder (its `score` head, no LM head): `LLMEngine.classify`'s
    probabilities equal the softmax of transformers' logits (1e-5), and the engine refuses generation;
  - relevance: the same with one label and a tokenizer with a pair template (a cross-encoder): `LLMEngine.relevance`
    equals the sigmoid of transformers' logit over the tokenizer's pair encoding; a causal LM judged by its "no" /
    "yes" logits (a Qwen3-Reranker, `classifier_from_tokens`) gives transformers' softmax over the two."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402  (after torch: it imports torch)

from pagedjax import (  # noqa: E402
    InvalidRequest,
    LLMEngine,
    ModelConfig,
    PoolingParams,
    SamplingParams,
    SchedulerConfig,
    UnsupportedFeature,
)
from pagedjax.model.classifier import Classifier  # noqa: E402
from pagedjax.model.errors import ModelLoadError  # noqa: E402

pytestmark = pytest.mark.hf

_rng = np.random.default_rng(4)
PROMPTS = [_rng.integers(0, 120, n).tolist() for n in (1, 6, 16, 29)]


def with_random_norms(model):
    """`model` with its norms' weights random around 1: a weight-loading mistake cannot hide behind ones."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def qwen3_embedding(folder, *, tie: bool = True):
    """A tiny random `Qwen3Model` (norms random too) saved with sentence-transformers' last-token + Normalize
    modules; returns the transformers model."""
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=tie, max_position_embeddings=128, initializer_range=0.2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = with_random_norms(transformers.Qwen3Model(config).eval())
    model.save_pretrained(str(folder), safe_serialization=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False,
         "pooling_mode_cls_token": False, "include_prompt": True}))
    return model


def hf_vector(model, prompt, pooling: str, dimensions=None, normalize=True) -> np.ndarray:
    with torch.no_grad():
        h = model(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling][:dimensions]
    return v / np.linalg.norm(v) if normalize else v


def assert_same(got, want) -> None:
    got = np.asarray(got, np.float64)
    assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) > 0.99999
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_a_qwen3_embedding_folder_gives_transformers_vectors(tmp_path):
    model = qwen3_embedding(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, dtype="float32", scheduler_config=SchedulerConfig(max_model_len=64))
    assert engine.config.pooling_defaults.describe().startswith("last token, normalized")
    for prompt, out in zip(PROMPTS, engine.embed(PROMPTS), strict=True):  # the folder's pooling
        assert_same(out.outputs.embedding, hf_vector(model, prompt, "last"))
    for pooling in ("mean", "cls"):
        params = PoolingParams(pooling, normalize=False, dimensions=48)
        for prompt, out in zip(PROMPTS, engine.embed(PROMPTS, params), strict=True):
            assert_same(out.outputs.embedding, hf_vector(model, prompt, pooling, 48, normalize=False))


def test_a_base_model_without_tied_embeddings_is_refused(tmp_path):
    qwen3_embedding(tmp_path, tie=False)
    with pytest.raises(ModelLoadError, match="without tied word embeddings has no LM head"):
        LLMEngine.from_pretrained(tmp_path, dtype="float32")


def qwen3_classifier(folder, labels=("neg", "neu", "pos")):
    """A tiny random `Qwen3ForSequenceClassification` (random norms and a large head: distinct probabilities)
    saved to `folder`; returns the transformers model."""
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, initializer_range=0.2, num_labels=len(labels),
                                      id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)},
                                      pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    model = with_random_norms(transformers.Qwen3ForSequenceClassification(config).eval())
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def test_a_sequence_classifier_gives_transformers_probabilities_and_refuses_generation(tmp_path):
    model = qwen3_classifier(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, dtype="float32", scheduler_config=SchedulerConfig(max_model_len=64))
    prompts = [p for p in PROMPTS if p[-1] != 0]  # transformers pools the last token that is not padding
    outs = engine.classify(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = torch.softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()
        np.testing.assert_allclose(out.outputs.probs, want, rtol=1e-5, atol=1e-6)
        assert out.outputs.labels == ("neg", "neu", "pos") and out.outputs.label == ("neg", "neu", "pos")[
            int(np.argmax(want))]
    assert len({o.outputs.label for o in outs}) > 1  # the head tells the prompts apart: a check that can fail
    with pytest.raises(UnsupportedFeature, match="sequence classifier, without an LM head") as e:
        engine.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.code == "generation_not_supported"
    assert not engine.has_unfinished_requests()


def test_classifier_folders_and_engines_that_cannot_classify_are_refused(tmp_path):
    qwen3_classifier(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(ModelLoadError, match="does not name labels 0..2"):
        LLMEngine.from_pretrained(tmp_path, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="score.weight"):  # a causal LM's folder with a head it does not know
        LLMEngine.from_pretrained(tmp_path, dtype="float32")
    plain = LLMEngine.from_pretrained(None, scheduler_config=SchedulerConfig(max_model_len=64))
    with pytest.raises(UnsupportedFeature, match="no classification head"):
        plain.classify([[1, 2]])
    with pytest.raises(ValueError, match="classifier: a Classifier over the model's"):
        LLMEngine(model_config=ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_q_heads=2, num_kv_heads=1,
                                           head_dim=8, intermediate_size=32),
                  classifier=Classifier(np.zeros((2, 3), np.float32), None, ("a", "b")))
    with pytest.raises(ValueError, match="weight \\(2, 3\\) for 1 labels"):
        Classifier(np.zeros((2, 3), np.float32), None, ("a",))


def pair_tokenizer(folder) -> None:
    """A word-level tokenizer.json whose pair template is `$A [SEP] $B [SEP]` (a cross-encoder's)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(126)} | {"[SEP]": 126, "[UNK]": 127}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A [SEP]", pair="$A [SEP] $B:1 [SEP]:1", special_tokens=[("[SEP]", 126)])
    tok.save(str(folder / "tokenizer.json"))


def test_a_cross_encoder_scores_pairs_as_transformers(tmp_path):
    model = qwen3_classifier(tmp_path, labels=("relevant",))
    pair_tokenizer(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, dtype="float32", scheduler_config=SchedulerConfig(max_model_len=64))
    query, docs = "w5 w17 w3", ["w9 w9 w40", "w5 w17", "w100"]
    outs = engine.relevance(query, docs)
    for doc, out in zip(docs, outs, strict=True):
        ids = [int(w[1:]) for w in query.split()] + [126] + [int(w[1:]) for w in doc.split()] + [126]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            want = torch.sigmoid(model(torch.tensor([ids])).logits[0, 0].double()).item()
        assert abs(out.outputs.score - want) < 1e-6
    assert len({round(o.outputs.score, 4) for o in outs}) == 3
    ids = engine.relevance([5, 17], [[9, 40]])[0]  # token ids: the query's then the document's, no template
    assert ids.prompt_token_ids == [5, 17, 9, 40]
    with pytest.raises(InvalidRequest, match="two texts or two token-id lists"):
        engine.relevance("w5", [[9, 40]])


def test_a_classifier_of_several_labels_scores_no_pairs(tmp_path):
    qwen3_classifier(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, dtype="float32", scheduler_config=SchedulerConfig(max_model_len=64))
    with pytest.raises(UnsupportedFeature, match="classifies into 3 labels"):
        engine.relevance([1, 2], [[3]])


@pytest.mark.parametrize("tie", [False, True])
def test_a_causal_lm_judged_by_two_tokens_scores_as_transformers_softmax(tmp_path, tie):
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=tie)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    pair_tokenizer(tmp_path)  # w0..w125, [SEP] = 126, [UNK] = 127: "no" / "yes" are the words w7 / w9 here
    engine = LLMEngine.from_pretrained(tmp_path, dtype="float32", classifier_from_tokens=("w7", "w9"),
                                       scheduler_config=SchedulerConfig(max_model_len=64))
    query, docs = [3, 1, 4], [[1, 5], [9, 2, 6, 5]]
    for doc, out in zip(docs, engine.relevance(query, docs), strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([query + doc])).logits[0, -1].double()
        assert abs(out.outputs.score - torch.softmax(logits[[7, 9]], -1)[1].item()) < 1e-6
    with pytest.raises(ValueError, match="no single token 'maybe'"):
        LLMEngine.from_pretrained(tmp_path, dtype="float32", classifier_from_tokens=("w7", "maybe"))


def test_classifier_from_tokens_for_a_classifier_folder_is_refused(tmp_path):
    qwen3_classifier(tmp_path)
    pair_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="has a classifier's head already"):
        LLMEngine.from_pretrained(tmp_path, dtype="float32", classifier_from_tokens=("w1", "w2"))


def test_the_command_lines_engine_has_the_folders_classifier_and_pooling(tmp_path):
    """pagedjax-serve / pagedjax-generate build their engine without `from_pretrained`: a classifier folder's
    engine must still hold its head (else it would generate from the embedding matrix standing in for a head it
    does not have), a sentence-transformers folder's its pooling, and --classifier-from-tokens a judge's head."""
    from pagedjax.cli.engine_setup import build_engine, load_model_for_cli
    from pagedjax.serve.cli import build_parser

    qwen3_classifier(tmp_path / "cls")
    pair_tokenizer(tmp_path / "cls")

    def engine(*flags):
        args = build_parser().parse_args([*flags, "--dtype", "float32", "--max-model-len", "64", "--no-warmup"])
        return build_engine(args, load_model_for_cli(args), compile_cache=False)

    cls = engine("--model", str(tmp_path / "cls"))
    assert cls.classifier is not None and cls.classifier.labels == ("neg", "neu", "pos")
    with pytest.raises(UnsupportedFeature, match="sequence classifier"):
        cls.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)
    qwen3_embedding(tmp_path / "emb")
    pair_tokenizer(tmp_path / "emb")
    config = json.loads((tmp_path / "emb" / "1_Pooling" / "config.json").read_text())
    (tmp_path / "emb" / "1_Pooling" / "config.json").write_text(json.dumps(
        {**config, "pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}))
    assert engine("--model", str(tmp_path / "emb")).config.pooling_defaults.pooling == "mean"
    judge = engine("--model", str(tmp_path / "emb"), "--classifier-from-tokens", "w7", "w9")
    assert judge.classifier.labels == ("w9",)
    from pagedjax.cli.errors import CLIError

    with pytest.raises(CLIError, match="has a classifier's head already"):
        engine("--model", str(tmp_path / "cls"), "--classifier-from-tokens", "w7", "w9")



def embedding_gemma(folder):
    """A tiny random EmbeddingGemma: transformers' `Gemma3TextModel` with `use_bidirectional_attention` (local
    layers of window 8, which transformers turns into 5 either way; a global one), saved with the
    sentence-transformers modules EmbeddingGemma has, as sentence-transformers writes them: mean pooling, two Dense
    projections (64 -> 96 -> 64, no bias, identity), Normalize. Returns the transformers model and the Dense
    weights."""
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], use_bidirectional_attention=True,
        initializer_range=0.2)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    model = with_random_norms(transformers.Gemma3TextModel(config).eval())
    model.save_pretrained(str(folder), safe_serialization=True)
    kinds = ("Transformer", "Pooling", "Dense", "Dense", "Normalize")
    paths = ["", "1_Pooling", "2_Dense", "3_Dense", "4_Normalize"]
    (folder / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
        for i, (k, p) in enumerate(zip(kinds, paths, strict=True))]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode": "mean", "include_prompt": True}))
    weights = []
    for path, (n_in, n_out) in zip(paths[2:4], ((64, 96), (96, 64)), strict=True):
        w = torch.randn(n_out, n_in) / n_in ** 0.5
        (folder / path).mkdir()
        (folder / path / "config.json").write_text(json.dumps(
            {"in_features": n_in, "out_features": n_out, "bias": False,
             "activation_function": "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": w.contiguous()}, str(folder / path / "model.safetensors"))
        weights.append(w)
    return model, weights


def test_an_embedding_gemma_folder_gives_transformers_vectors(tmp_path):
    """Attention both ways (within 4 positions either way in the local layers), mean pooling and the Dense
    projections: the engine's vectors are those of transformers' hidden states, pooled and projected by the
    definition; prompts longer than the window, batched in one step; generation is refused."""
    model, (w1, w2) = embedding_gemma(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, dtype="float32", scheduler_config=SchedulerConfig(max_model_len=64))
    assert engine.model_spec.bidirectional and engine.model_config.sliding_windows == (5, None, 5)
    assert engine.config.pooling_defaults.describe().startswith("mean, Dense 64 -> 96, Dense 96 -> 64, normalized")
    for prompt, out in zip(PROMPTS, engine.embed(PROMPTS), strict=True):
        with torch.no_grad():
            v = w2 @ (w1 @ model(torch.tensor([prompt])).last_hidden_state[0].mean(0))
        want = v.double().numpy() / float(v.double().norm())
        assert_same(out.outputs.embedding, want)
    with pytest.raises(UnsupportedFeature, match="attention goes both ways") as e:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert e.value.code == "generation_not_supported"


def test_sentence_transformers_reads_the_dense_modules_pagedjax_reads(tmp_path):
    """The Dense files of the fixture above are sentence-transformers' format: its own `Dense.load` reads them to
    the same projection (a check of the fixture, where sentence-transformers is installed)."""
    st = pytest.importorskip("sentence_transformers.models")
    _, (w1, _) = embedding_gemma(tmp_path)
    dense = st.Dense.load(str(tmp_path / "2_Dense"))
    x = torch.randn(1, 64)
    with torch.no_grad():
        np.testing.assert_allclose(dense({"sentence_embedding": x})["sentence_embedding"].numpy(),
                                   (x @ w1.T).numpy(), rtol=1e-6)
