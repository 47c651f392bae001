"""Hugging Face interop: parameters and tokenizers to and from `transformers`."""

from bertjax.hf.convert import (HFConversionError, ImportReport, copy_tokenizer_files, export_hf,
                                export_tokenizer, from_hf_state_dict, hf_config_dict, import_hf,
                                model_config_from_hf, read_safetensors, to_hf_state_dict)

__all__ = ["HFConversionError", "ImportReport", "copy_tokenizer_files", "export_hf",
           "export_tokenizer", "from_hf_state_dict", "hf_config_dict", "import_hf",
           "model_config_from_hf", "read_safetensors", "to_hf_state_dict"]
