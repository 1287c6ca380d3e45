"""Images in prompts, the model side: everything between an image file and the feature rows a vision-language
model puts in place of its placeholder tokens.

  processor.py       an image file -> pixels (decode, resize, normalise: numpy + Pillow, no JAX) and a prompt's
                     placeholders expanded to one token per feature row; a model folder's processor
  vit.py             the ViT blocks the towers share; clip.py, siglip.py: LLaVA's and Gemma 3's vision towers
  vlm.py             the base of the vision-language models: a tower, a projector, a text decoder of the contract
  llava.py, gemma3_vision.py   LLaVA and Gemma 3 with images, models of the public contract
  hf_vision.py       a Hugging Face folder of either: config mapping, weights (`pagedjax.model.families` entry)

Where the other layers keep their part (the layer rule keeps each there): the host's view of a prompt's images
(placeholder spans, content hashes, the encoder cache of computed features) in `pagedjax.core.images` and
`pagedjax.core.encoder_cache`, plain Python under the scheduler; a step's image inputs in `pagedjax.runner.images`;
a prompt's images decoded and hashed in `pagedjax.engine.image_prompts`; the server's image parts and limits in
`pagedjax.serve.images`.
"""
