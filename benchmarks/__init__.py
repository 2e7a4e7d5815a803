"""Speed measurements of vision-attn against its peers, run from a source checkout (`vision-attn benchmark`)."""
