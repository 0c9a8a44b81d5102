"""Integrations with other libraries, each imported on its own and only on demand.

    import longflash.integrations.transformers as lf_hf
    lf_hf.register()   # attn_implementation="LongFlash" in Hugging Face transformers

Importing `longflash` (or this package) imports none of those libraries; each
integration imports its library inside the function that needs it.
"""
