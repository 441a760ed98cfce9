"""oxygen_ros.model: the pi0.5 network (PyTorch + transformers, never rclpy), its configs and presets, checkpoint
loading, tokenizers and pre/post-processing.  See ARCHITECTURE.md "Contract: model"."""
from .config import GemmaConfig, Pi05Config, VisionConfig, get_config
from .pi05 import DecodeBatch, DecodeOutput, Pi05Model, Prefix, SamplingParams, build_model, sample_tokens
from .tokenizer import ByteTokenizer, SentencePieceTokenizer, StreamDecoder, Tokenizer, load_tokenizer
from .processing import ModelInputs, NormStats, Observation, Processor
from .checkpoint import CheckpointError, LoadedPolicy, load_checkpoint, save_checkpoint

__all__ = [
    "GemmaConfig", "Pi05Config", "VisionConfig", "get_config",
    "DecodeBatch", "DecodeOutput", "Pi05Model", "Prefix", "SamplingParams", "build_model", "sample_tokens",
    "ByteTokenizer", "SentencePieceTokenizer", "StreamDecoder", "Tokenizer", "load_tokenizer",
    "ModelInputs", "NormStats", "Observation", "Processor",
    "CheckpointError", "LoadedPolicy", "load_checkpoint", "save_checkpoint",
]
