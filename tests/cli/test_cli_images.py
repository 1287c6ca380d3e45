"""`pagedjax-generate --image`: a vision-language folder's prompt with image files, as the Python API runs it."""

from __future__ import annotations

import json

import pytest

from pagedjax import CacheConfig, LLMEngine, SamplingParams, cli
from tests.model.vision_folders import hf_model, random_images, save_folder

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_images")
    folder = save_folder("llava", root / "llava", model=hf_model("llava", 0))
    png = root / "a.png"
    random_images(3)[0].save(png)
    return folder, png


def _json_run(capsys, argv) -> dict:
    assert cli.main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_an_image_file_reaches_the_prompt_as_the_python_api_gives_it(files, capsys):
    from PIL import Image

    folder, png = files
    argv = ["--model", str(folder), "--prompt", PROMPT, "--image", str(png), "--max-tokens", "5", "--temperature",
            "0", "--ignore-eos", "--json", "--num-blocks", "32"]
    (got,) = _json_run(capsys, argv)["completions"]
    engine = LLMEngine.from_pretrained(str(folder), cache_config=CacheConfig(num_blocks=32))
    with Image.open(png) as image:
        (want,) = engine.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}],
                                  SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert got["text"] == want.outputs[0].text and got["num_tokens"] == 5
    # The image encoder's program is obtained and timed as the steps' are: tokens/s, "compiles excluded", leaves
    # its compile out (it was counted in the steps' time, and in no compile count).
    stats, encoder = engine.stats(), engine.runner.image_features.programs
    assert encoder.num_compilations == 1 and stats.compilations == engine.runner.programs.num_compilations + 1
    assert stats.compile_s == pytest.approx(engine.runner.programs.compile_seconds + encoder.compile_seconds)
    assert stats.step_s == pytest.approx(stats.elapsed_s - stats.compile_s) and stats.images_encoded == 1
    # the placeholder expanded to the image's tokens
    assert got["num_prompt_tokens"] == len(want.prompt_token_ids) > len(engine.tokenizer.encode(PROMPT))


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "a <image>", "--prompt", "b", "--image", "x.png"], "--image needs exactly one prompt"),
    (["--demo", "--image", "x.png"], "--demo uses its own prompts"),
    (["--prompt", "a <image>", "--image", "x.png", "--beam-width", "2"], "--image does not combine with --beam-width"),
])
def test_image_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bad_image_files_and_mismatched_placeholders_are_one_line_errors(files, tmp_path, capsys):
    folder, png = files
    text = tmp_path / "not_an_image.png"
    text.write_text("hello")
    for image, message in ((tmp_path / "missing.png", "missing.png: cannot read it as an image"),
                           (text, "not_an_image.png: cannot read it as an image")):
        assert cli.main(["--model", str(folder), "--prompt", PROMPT, "--image", str(image)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    # two images for one placeholder: the engine's check, as a one-line error naming the placeholder
    assert cli.main(["--model", str(folder), "--prompt", PROMPT, "--image", str(png), "--image", str(png),
                     "--num-blocks", "32"]) == 2
    err = capsys.readouterr().err
    assert "the prompt names 1 images ('<image>'), but multi_modal_data has 2" in err, err
    # a text-only model (the bundled one) takes no images
    assert cli.main(["--prompt", "def f(<image>):", "--image", str(png), "--num-blocks", "32"]) == 2
    err = capsys.readouterr().err
    assert "image" in err and "Traceback" not in err, err


def test_the_servers_engine_of_a_vision_folder_takes_images(files):
    """`pagedjax-serve --model` builds its engine as `pagedjax-generate` does (`build_engine`): with the folder's
    image processor, which the server's image parts need (it refused the folder before)."""
    from pagedjax.cli.engine_setup import build_engine, load_model_for_cli
    from pagedjax.serve import cli as serve_cli
    from pagedjax.serve.chat_template import ChatTemplate
    from pagedjax.serve.images import ImageSupport

    folder, _ = files
    args = serve_cli.build_parser().parse_args(["--model", str(folder), "--num-blocks", "32", "--no-warmup"])
    engine = build_engine(args, load_model_for_cli(args), compile_cache=False)
    try:
        support = ImageSupport.for_engine(engine, ChatTemplate.from_model(folder, None))
        assert support is not None and support.processor.placeholder == "<image>"
    finally:
        engine.close()
