"""Hugging Face interop: parameters and tokenizers to and from `transformers`; each model
family's formats registered here, one line each (bertjax/hf/formats.py)."""

from bertjax.hf import (
  albert,
  bart,
  bert,
  deberta,
  distilbert,
  electra,
  formats,
  gpt,
  modernbert,
                                t5,
)
from bertjax.hf.convert import (
  HFConversionError,
  ImportReport,
  copy_tokenizer_files,
  export_hf,
  export_tokenizer,
  format_for,
  from_hf_state_dict,
  hf_config_dict,
  import_hf,
  model_config_from_hf,
  read_safetensors,
  to_hf_state_dict,
)

formats.register(*bert.FORMATS)
formats.register(*albert.FORMATS)
formats.register(*distilbert.FORMATS)
formats.register(*electra.FORMATS)
formats.register(*modernbert.FORMATS)
formats.register(*deberta.FORMATS)
formats.register(*gpt.FORMATS)
formats.register(*t5.FORMATS)
formats.register(*bart.FORMATS)

__all__ = ["HFConversionError", "ImportReport", "copy_tokenizer_files", "export_hf",
           "export_tokenizer", "format_for", "from_hf_state_dict", "hf_config_dict", "import_hf",
           "model_config_from_hf", "read_safetensors", "to_hf_state_dict"]
