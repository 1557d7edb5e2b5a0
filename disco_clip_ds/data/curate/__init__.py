"""`disco-clip data filter`: curation of webdataset shards by the rules DataComp and LAION use (CLIP score, image
clusters near a target set, copies of eval images, copies within the set), written as new shards with their teacher
embeddings, a parquet of every input key and a summary. pipeline.py runs it; one module per rule or output."""
