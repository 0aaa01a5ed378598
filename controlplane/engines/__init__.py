"""Engine telemetry: the controller scrapes each READY replica's model server
(parse.py reads the Prometheus text of vLLM, SGLang, llama.cpp and TGI; scraper.py
owns the HTTP session, the schedule and the publishing), and every proxy reads the
compact view it publishes (proxy/wire/engines.py). docs/engines.md has the why.
"""
