"""The target model: finding, checking and loading it, its families, quantized weights, remote code, chat."""
