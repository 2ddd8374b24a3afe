"""How long a batch waits for more rows, by what the model takes: declared once, for the server's
defaults and for `tune`'s search alike."""

# An image model's window unless its serving.json or --max-delay-ms says otherwise: the oldest queued
# image waits this long for a fuller batch (Triton's max_queue_delay).
IMAGE_MAX_DELAY_MS = 5.0

# A text model's: a batch is cut as soon as an instance is free, from whatever is queued (continuous
# batching, as text-embeddings-inference and infinity batch). A transformer's batch costs about its
# tokens, so waiting for a fuller one buys little under load (the texts that arrive while a batch runs
# form the next) and costs every request of a lone client the whole window.
TEXT_MAX_DELAY_MS = 0.0

