"""The transformers config of a stablegpt model that no transformers class computes (GPT-2 with the embedding
LayerNorm, NormFormer, qk-layernorm, rotary with LayerNorm, ...): tools/export_hf.py copies this file and
modeling_stablegpt.py next to the weights, and config.json's auto_map points AutoConfig and
AutoModelForCausalLM at them (`trust_remote_code=True`).

Self-contained: torch and transformers only, never the stablegpt repository, so that the export loads anywhere.
The keys are stablegpt's own (Megatron's flag names, as in its model.py); transformers' generic names
(num_hidden_layers, num_key_value_heads) are aliases of them.
"""

from transformers import PretrainedConfig


class StableGPTConfig(PretrainedConfig):
    model_type = "stablegpt"
    attribute_map = {
        "num_hidden_layers": "num_layers",
        "num_key_value_heads": "num_query_groups",
        "intermediate_size": "ffn_hidden_size",
    }

    def __init__(
        self,
        vocab_size=50257,
        hidden_size=768,
        num_layers=12,
        num_attention_heads=12,
        num_query_groups=None,
        ffn_hidden_size=None,
        seq_length=1024,
        max_position_embeddings=None,
        layernorm_epsilon=1e-5,
        normalization="layernorm",
        swiglu=False,
        activation="gelu",
        add_bias_linear=True,
        position_embedding_type="learned",
        rotary_base=10000.0,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        embed_layernorm=False,
        scale_embeddings=False,
        qk_layernorm=False,
        normformer=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        embed_dropout=None,
        initializer_range=0.02,
        tie_word_embeddings=True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        # key/value heads, each shared by num_attention_heads / num_query_groups query heads (None: one per head)
        self.num_query_groups = num_query_groups or num_attention_heads
        self.ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        self.seq_length = seq_length  # rows of the learned position table; the trained context
        # the context the model is made for
        self.max_position_embeddings = max_position_embeddings or seq_length
        self.layernorm_epsilon = layernorm_epsilon
        self.normalization = normalization  # layernorm | rmsnorm: every norm of the model
        self.swiglu = swiglu  # fc2(SiLU(gate(x)) * fc1(x)); activation unused then
        self.activation = activation  # gelu (erf) | gelu_tanh | relu
        self.add_bias_linear = add_bias_linear
        self.position_embedding_type = position_embedding_type  # learned | alibi | rotary
        self.rotary_base = rotary_base
        self.use_rope_scaling = use_rope_scaling  # Llama 3.1's long-context frequencies
        self.rope_scaling_factor = rope_scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        # a norm on the word embeddings (bitsandbytes' StableEmbedding)
        self.embed_layernorm = embed_layernorm
        self.scale_embeddings = scale_embeddings  # word embeddings times sqrt(hidden_size)
        self.qk_layernorm = qk_layernorm  # a norm over head_dim on each head's q and k
        self.normformer = normformer  # NormFormer's head scales and its two extra norms
        self.hidden_dropout = hidden_dropout
        self.attention_dropout = attention_dropout
        self.embed_dropout = hidden_dropout if embed_dropout is None else embed_dropout
        # only for a model built from this config, not loaded
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
