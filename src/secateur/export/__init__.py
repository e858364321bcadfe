"""Export: output folders (:mod:`folder`: checks, atomic writes, overwrite rules), masked runs as Hugging Face
folders (:mod:`hf`: weights, report, bit-packed masks), sliced models (:mod:`sliced`: stock or per-layer
configs), run folders as GGUF files for llama.cpp (:mod:`gguf`), and every folder's model card and recipe
(:mod:`card`)."""
