"""Images in, text out: vision-language models.

Engine side (what this package's modules below own):

- ``inputs``: ``ImageInput``, one preprocessed image of a prompt as it crosses to the engine
  core (pixel values, grid, content hash, where its placeholder tokens sit), and the prefix-cache
  keys of a prompt with images. Torch-free.
- ``processor``: the front end's image preprocessing with the checkpoint's own Hugging Face
  image processor, and the expansion of each image's placeholder token to its feature count.
- ``encoder_cache``: the vision encoder's outputs by image hash under a byte budget, and the
  per-step work of the model runner (encode missing images, slice each chunk's image rows,
  multimodal rotary positions).
"""
