import re, sys, time, urllib.request
out = open(sys.argv[1], "a")
names = ["pdserve_time_to_first_token_seconds_sum", "pdserve_time_to_first_token_seconds_count",
         "pdserve_time_between_tokens_seconds_sum", "pdserve_time_between_tokens_seconds_count"]
while True:
    try:
        text = urllib.request.urlopen("http://127.0.0.1:18431/metrics", timeout=5).read().decode()
        vals = []
        for n in names:
            m = re.search(r"^" + n + r"\{[^}]*role=\"prefill\"[^}]*\} (\S+)", text, re.M)
            vals.append(m.group(1) if m else "nan")
        out.write(f"{time.time():.3f} " + " ".join(vals) + "\n"); out.flush()
    except Exception as exc:
        out.write(f"# {time.time():.3f} {exc}\n"); out.flush()
    time.sleep(1.0)
