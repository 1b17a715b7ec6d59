"""Images in, text out: vision-language models.

Front end (the door):

- ``options``: the media flags checked into ``MediaConfig`` (standard library only).
- ``media``: ``ImageLoader``, loading the images clients send (``data:`` URLs, allowed
  ``http(s)`` hosts, allowed local paths) within limits, decoding on worker threads.
- ``chat_parts``: finding images in chat messages and the other APIs' content blocks; the
  conversation becomes vLLM's prompt form, ``{"prompt": <the chat template's text, the model's
  image placeholder once per image>, "multi_modal_data": {"image": [PIL.Image, ...]}}``, handed
  to the engine through the same entry as a text prompt.

Engine side:

- ``inputs``: ``ImageInput``, one preprocessed image of a prompt as it crosses to the engine
  core (pixel values, grid, content hash, where its placeholder tokens sit), and the prefix-cache
  keys of a prompt with images. Torch-free.
- ``processor``: the front end's image preprocessing with the checkpoint's own Hugging Face
  image processor, and the expansion of each image's placeholder token to its feature count.
- ``encoder_cache``: the vision encoder's outputs by image hash under a byte budget, and the
  per-step work of the model runner (encode missing images, slice each chunk's image rows,
  multimodal rotary positions).
"""
