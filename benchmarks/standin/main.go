// Command standin is the data-plane benchmark's fast stand-in for an OpenAI-compatible inference
// server, and its load generator (benchmarks/bench_dataplane.py builds and drives it).
//
//	standin serve --port P [--host 127.0.0.1] [--ttft-ms 0] [--gap-ms 0] [--model-delay NAME=MS ...]
//	standin load --url URL --mode latency --n N [--stream] [--header K:V ...] [--model M]
//	standin load --url URL --mode rate --rate R --duration S
//	standin load --url URL --mode streams --streams K --tokens T
//
// serve answers like vLLM behind uvicorn, only without a model: GET /health, GET /v1/models,
// GET /metrics (vLLM's gauges: running = requests in progress, waiting = 0, KV cache use 0) and
// POST /v1/chat/completions, which waits --ttft-ms (a header X-Standin-Delay-Ms, or a model named
// by --model-delay, overrides it) and then answers max_tokens (default 16) words (" tok", " tik",
// " tak", " tek" in turn: one word over and over trips LiteLLM's loop detector): in one
// chat.completion, or streamed as vLLM streams them (a role chunk, one chunk per token, the last
// one with finish_reason "length", a usage chunk when stream_options.include_usage, then
// "data: [DONE]"), each event flushed on its own, --gap-ms apart, chunked, no Content-Length.
//
// load prints one JSON object on stdout: latencies at concurrency 1 (--mode latency), an open
// loop at a fixed rate (--mode rate), or K concurrent streams started at once (--mode streams).
// Times are in milliseconds. A request that fails (no answer, a status other than 200, a stream
// cut short) counts as an error; the generator never stops for one. --raw adds the samples.
//
// Go 1.19, the standard library only.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	switch os.Args[1] {
	case "serve":
		serve(os.Args[2:])
	case "load":
		load(os.Args[2:])
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: standin serve --port P [--ttft-ms MS] [--gap-ms MS] [--model-delay NAME=MS]\n"+
		"       standin load --url URL --mode latency|rate|streams [options] (standin load -h)")
	os.Exit(2)
}

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ", ") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// ---------------------------------------------------------------------------------------------
// serve

type server struct {
	ttft    time.Duration
	gap     time.Duration
	models  []string                 // listed by /v1/models, "standin" first
	delays  map[string]time.Duration // per model, from --model-delay
	running int64                    // chat requests in progress (atomic)
	seq     uint64                   // completion ids (atomic)
}

type chatRequest struct {
	Model               string `json:"model"`
	MaxTokens           *int   `json:"max_tokens"`
	MaxCompletionTokens *int   `json:"max_completion_tokens"`
	Stream              bool   `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

const promptTokens = 16

// vocabulary: the tokens answered, in turn. Not one token over and over: LiteLLM ends a stream
// whose last 100 chunks are the same (REPEATED_STREAMING_CHUNK_LIMIT) as a model caught in a loop.
var vocabulary = [...]string{" tok", " tik", " tak", " tek"}

func millis(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

func serve(args []string) {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	host := fs.String("host", "127.0.0.1", "listen address")
	port := fs.Int("port", 8000, "listen port")
	ttftMs := fs.Float64("ttft-ms", 0, "milliseconds before the answer (streams: before the first chunk)")
	gapMs := fs.Float64("gap-ms", 0, "milliseconds between two streamed tokens (0: as fast as possible)")
	var modelDelays listFlag
	fs.Var(&modelDelays, "model-delay", "NAME=MS: also serve model NAME, answering after MS (repeatable)")
	fs.Parse(args)

	s := &server{ttft: millis(*ttftMs), gap: millis(*gapMs), models: []string{"standin"},
		delays: map[string]time.Duration{}}
	for _, spec := range modelDelays {
		name, ms, ok := strings.Cut(spec, "=")
		value, err := strconv.ParseFloat(ms, 64)
		if !ok || name == "" || err != nil || value < 0 {
			fmt.Fprintf(os.Stderr, "standin: --model-delay %q: expected NAME=MS\n", spec)
			os.Exit(2)
		}
		s.models = append(s.models, name)
		s.delays[name] = millis(value)
	}

	mux := http.NewServeMux()
	mux.HandleFunc("/health", s.health)
	mux.HandleFunc("/v1/models", s.listModels)
	mux.HandleFunc("/metrics", s.metrics)
	mux.HandleFunc("/v1/chat/completions", s.chat)
	address := net.JoinHostPort(*host, strconv.Itoa(*port))
	listener, err := net.Listen("tcp", address)
	if err != nil {
		fmt.Fprintf(os.Stderr, "standin: %v\n", err)
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "standin listening on http://%s\n", listener.Addr())
	httpServer := &http.Server{Handler: mux, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 5 * time.Minute}
	if err := httpServer.Serve(listener); err != nil {
		fmt.Fprintf(os.Stderr, "standin: %v\n", err)
		os.Exit(1)
	}
}

func writeJSON(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	w.Write(body)
}

func writeError(w http.ResponseWriter, status int, message string) {
	body, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": message, "type": "invalid_request_error", "param": nil, "code": status}})
	writeJSON(w, status, body)
}

func (s *server) health(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, []byte(`{"status":"ok"}`))
}

func (s *server) listModels(w http.ResponseWriter, r *http.Request) {
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int    `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	data := make([]model, 0, len(s.models))
	for _, name := range s.models {
		data = append(data, model{name, "model", 0, "standin"})
	}
	body, _ := json.Marshal(struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{"list", data})
	writeJSON(w, http.StatusOK, body)
}

func (s *server) metrics(w http.ResponseWriter, r *http.Request) {
	running := atomic.LoadInt64(&s.running)
	body := fmt.Sprintf("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"+
		"# TYPE vllm:num_requests_running gauge\n"+
		"vllm:num_requests_running{engine=\"0\",model_name=\"standin\"} %d.0\n"+
		"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"+
		"# TYPE vllm:num_requests_waiting gauge\n"+
		"vllm:num_requests_waiting{engine=\"0\",model_name=\"standin\"} 0.0\n"+
		"# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"+
		"# TYPE vllm:kv_cache_usage_perc gauge\n"+
		"vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"standin\"} 0.0\n", running)
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	io.WriteString(w, body)
}

func (s *server) chat(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		writeError(w, http.StatusMethodNotAllowed, "POST only")
		return
	}
	atomic.AddInt64(&s.running, 1)
	defer atomic.AddInt64(&s.running, -1)

	raw, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 16<<20))
	if err != nil {
		writeError(w, http.StatusBadRequest, "cannot read the body: "+err.Error())
		return
	}
	var req chatRequest
	if err := json.Unmarshal(raw, &req); err != nil {
		writeError(w, http.StatusBadRequest, "the body is not a JSON object: "+err.Error())
		return
	}
	tokens := 16
	if req.MaxTokens != nil {
		tokens = *req.MaxTokens
	} else if req.MaxCompletionTokens != nil {
		tokens = *req.MaxCompletionTokens
	}
	if tokens < 1 || tokens > 1_000_000 {
		writeError(w, http.StatusBadRequest, "max_tokens must be between 1 and 1000000")
		return
	}
	model := req.Model
	if model == "" {
		model = "standin"
	}

	delay := s.ttft
	if d, ok := s.delays[model]; ok {
		delay = d
	}
	if header := r.Header.Get("X-Standin-Delay-Ms"); header != "" {
		if ms, err := strconv.ParseFloat(header, 64); err == nil && ms >= 0 {
			delay = millis(ms)
		}
	}
	if delay > 0 {
		timer := time.NewTimer(delay)
		select {
		case <-timer.C:
		case <-r.Context().Done():
			timer.Stop()
			return
		}
	}

	id := fmt.Sprintf("chatcmpl-standin%016x", atomic.AddUint64(&s.seq, 1))
	created := time.Now().Unix()
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}`,
		promptTokens, promptTokens+tokens, tokens)
	modelJSON, _ := json.Marshal(model)
	if !req.Stream {
		var words strings.Builder
		for i := 0; i < tokens; i++ {
			words.WriteString(vocabulary[i%len(vocabulary)])
		}
		content := strings.TrimPrefix(words.String(), " ")
		body := fmt.Sprintf(`{"id":%q,"object":"chat.completion","created":%d,"model":%s,"choices":[{"index":0,`+
			`"message":{"role":"assistant","content":%q},"logprobs":null,"finish_reason":"length"}],"usage":%s}`,
			id, created, modelJSON, content, usage)
		writeJSON(w, http.StatusOK, []byte(body))
		return
	}

	flusher, ok := w.(http.Flusher)
	if !ok {
		writeError(w, http.StatusInternalServerError, "streaming unsupported")
		return
	}
	header := w.Header()
	header.Set("Content-Type", "text/event-stream; charset=utf-8")
	header.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)

	head := []byte(fmt.Sprintf(`data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,`,
		id, created, modelJSON))
	event := make([]byte, 0, 512)
	send := func(rest string) bool {
		event = append(append(append(event[:0], head...), rest...), "\n\n"...)
		if _, err := w.Write(event); err != nil {
			return false
		}
		flusher.Flush()
		return r.Context().Err() == nil
	}
	if !send(`"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`) {
		return
	}
	for i := 1; i <= tokens; i++ {
		if i > 1 && s.gap > 0 {
			time.Sleep(s.gap)
		}
		finish := `null`
		if i == tokens {
			finish = `"length"`
		}
		if !send(`"choices":[{"index":0,"delta":{"content":"` + vocabulary[(i-1)%len(vocabulary)] +
			`"},"logprobs":null,"finish_reason":` + finish + `}]}`) {
			return
		}
	}
	if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
		if !send(`"choices":[],"usage":` + usage + `}`) {
			return
		}
	}
	w.Write([]byte("data: [DONE]\n\n"))
	flusher.Flush()
}

// ---------------------------------------------------------------------------------------------
// load

type generator struct {
	client  *http.Client
	url     string
	model   string
	headers [][2]string
}

// outcome is one request's: times in ms from its (intended) start.
type outcome struct {
	err    string    // "" when it succeeded
	ttft   float64   // streams: the first content chunk; -1 when none came
	total  float64   // the whole answer (a stream: through [DONE])
	chunks int       // streams: content chunks received
	done   bool      // streams: [DONE] received
	gaps   []float64 // streams, when asked: between consecutive content chunks
}

func (g *generator) body(stream bool, tokens int) []byte {
	body := map[string]any{
		"model":      g.model,
		"messages":   []map[string]string{{"role": "user", "content": "Write a short poem about schedulers."}},
		"max_tokens": tokens,
		"stream":     stream,
	}
	if stream {
		body["stream_options"] = map[string]bool{"include_usage": true}
	}
	raw, _ := json.Marshal(body)
	return raw
}

func since(start time.Time) float64 { return float64(time.Since(start)) / float64(time.Millisecond) }

// isContent: whether an event's data is a chunk whose delta has non-empty content. A byte scan,
// not a JSON parse (cheap on the generator's core); it allows the spaces json.dumps puts in.
func isContent(data []byte) bool {
	at := bytes.Index(data, []byte(`"content"`))
	if at < 0 {
		return false
	}
	rest := bytes.TrimLeft(data[at+len(`"content"`):], " ")
	if len(rest) == 0 || rest[0] != ':' {
		return false
	}
	rest = bytes.TrimLeft(rest[1:], " ")
	return len(rest) >= 2 && rest[0] == '"' && rest[1] != '"'
}

func (g *generator) do(body []byte, stream bool, start time.Time, keepGaps bool) (o outcome) {
	o.ttft = -1
	req, err := http.NewRequest(http.MethodPost, g.url, bytes.NewReader(body))
	if err != nil {
		o.err = err.Error()
		return
	}
	req.Header.Set("Content-Type", "application/json")
	for _, kv := range g.headers {
		req.Header.Set(kv[0], kv[1])
	}
	resp, err := g.client.Do(req)
	if err != nil {
		o.err = err.Error()
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		text, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
		o.err = fmt.Sprintf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(text)))
		return
	}
	if !stream {
		text, err := io.ReadAll(resp.Body)
		o.total = since(start)
		if err != nil {
			o.err = "reading the answer: " + err.Error()
		} else if !bytes.Contains(text, []byte(`"choices"`)) {
			o.err = "an answer without choices: " + string(text[:min(len(text), 200)])
		}
		return
	}
	reader := bufio.NewReaderSize(resp.Body, 64<<10)
	var long []byte // a line longer than the buffer, put together
	last := time.Time{}
	for {
		line, err := reader.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			long = append(long, line...)
			continue
		}
		if long != nil {
			line = append(long, line...)
			long = nil
		}
		if data := bytes.TrimRight(line, "\r\n"); bytes.HasPrefix(data, []byte("data:")) {
			data = bytes.TrimLeft(data[len("data:"):], " ")
			if bytes.Equal(data, []byte("[DONE]")) {
				o.done = true
				o.total = since(start)
				io.Copy(io.Discard, resp.Body) // to the end, so that the connection is reused
				break
			}
			if isContent(data) {
				now := time.Now()
				if o.chunks == 0 {
					o.ttft = float64(now.Sub(start)) / float64(time.Millisecond)
				} else if keepGaps {
					o.gaps = append(o.gaps, float64(now.Sub(last))/float64(time.Millisecond))
				}
				last = now
				o.chunks++
			}
		}
		if err != nil {
			if err == io.EOF {
				o.err = "the stream ended without [DONE]"
			} else {
				o.err = "reading the stream: " + err.Error()
			}
			o.total = since(start)
			break
		}
	}
	return
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}

// percentile: linear interpolation between the closest ranks (numpy's default); NaN when empty.
func percentile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	rank := q / 100 * float64(len(sorted)-1)
	low := int(math.Floor(rank))
	high := int(math.Ceil(rank))
	return sorted[low] + (sorted[high]-sorted[low])*(rank-float64(low))
}

func round3(x float64) any {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return nil
	}
	return math.Round(x*1000) / 1000
}

// summary: p50/p90/p99/max/mean of values, in ms, rounded to microseconds (null when empty).
func summary(values []float64) map[string]any {
	sorted := append([]float64(nil), values...)
	sort.Float64s(sorted)
	mean := math.NaN()
	if len(sorted) > 0 {
		total := 0.0
		for _, v := range sorted {
			total += v
		}
		mean = total / float64(len(sorted))
	}
	maximum := math.NaN()
	if len(sorted) > 0 {
		maximum = sorted[len(sorted)-1]
	}
	return map[string]any{"n": len(sorted), "p50": round3(percentile(sorted, 50)), "p90": round3(percentile(sorted, 90)),
		"p99": round3(percentile(sorted, 99)), "max": round3(maximum), "mean": round3(mean)}
}

func rounded(values []float64) []any {
	out := make([]any, len(values))
	for i, v := range values {
		out[i] = round3(v)
	}
	return out
}

// errorSamples: how many requests failed, and up to three distinct reasons.
func errorSamples(outcomes []outcome) (int, []string) {
	count := 0
	samples := []string{}
	for _, o := range outcomes {
		if o.err == "" {
			continue
		}
		count++
		if len(samples) < 3 {
			seen := false
			for _, s := range samples {
				seen = seen || s == o.err
			}
			if !seen {
				samples = append(samples, o.err)
			}
		}
	}
	return count, samples
}

func load(args []string) {
	fs := flag.NewFlagSet("load", flag.ExitOnError)
	url := fs.String("url", "", "the full URL to POST chat completions to")
	mode := fs.String("mode", "latency", "latency | rate | streams")
	model := fs.String("model", "standin", "the model to ask for")
	var headers listFlag
	fs.Var(&headers, "header", "K:V, sent with every request (repeatable)")
	n := fs.Int("n", 100, "latency: requests, one after the other")
	warmup := fs.Int("warmup", 0, "latency: requests sent first and not counted")
	stream := fs.Bool("stream", false, "latency: stream the answers")
	maxTokens := fs.Int("max-tokens", 16, "latency and rate: max_tokens of each request")
	rate := fs.Float64("rate", 100, "rate: requests started per second")
	duration := fs.Float64("duration", 4, "rate: seconds of sending")
	streams := fs.Int("streams", 64, "streams: concurrent streams")
	tokens := fs.Int("tokens", 256, "streams: tokens of each stream")
	timeout := fs.Float64("timeout", 120, "seconds a request may take in all before it counts as an error")
	raw := fs.Bool("raw", false, "add the samples (ms) to the output")
	fs.Parse(args)
	if *url == "" {
		fmt.Fprintln(os.Stderr, "standin load: --url is required")
		os.Exit(2)
	}

	g := &generator{url: *url, model: *model}
	for _, h := range headers {
		k, v, ok := strings.Cut(h, ":")
		if !ok || strings.TrimSpace(k) == "" {
			fmt.Fprintf(os.Stderr, "standin load: --header %q: expected K:V\n", h)
			os.Exit(2)
		}
		g.headers = append(g.headers, [2]string{strings.TrimSpace(k), strings.TrimSpace(v)})
	}
	idle := 1024
	if *streams > idle {
		idle = *streams
	}
	transport := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        0, // no limit
		MaxIdleConnsPerHost: idle,
		IdleConnTimeout:     3 * time.Second, // under the gateways' keep-alive timeouts (apsd: 5 s)
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
	}
	g.client = &http.Client{Transport: transport, Timeout: time.Duration(*timeout * float64(time.Second))}

	report := map[string]any{"mode": *mode, "url": *url, "model": *model}
	switch *mode {
	case "latency":
		latencyMode(g, report, *n, *warmup, *stream, *maxTokens, *raw)
	case "rate":
		rateMode(g, report, *rate, *duration, *maxTokens, *raw)
	case "streams":
		streamsMode(g, report, *streams, *tokens, *raw)
	default:
		fmt.Fprintf(os.Stderr, "standin load: unknown --mode %q\n", *mode)
		os.Exit(2)
	}
	out, _ := json.Marshal(report)
	os.Stdout.Write(append(out, '\n'))
}

func latencyMode(g *generator, report map[string]any, n, warmup int, stream bool, tokens int, raw bool) {
	body := g.body(stream, tokens)
	for i := 0; i < warmup; i++ {
		g.do(body, stream, time.Now(), false)
	}
	outcomes := make([]outcome, 0, n)
	var ttft, total []float64
	chunks := 0
	for i := 0; i < n; i++ {
		o := g.do(body, stream, time.Now(), false)
		if stream && o.err == "" && (!o.done || o.chunks != tokens) {
			o.err = fmt.Sprintf("incomplete stream: %d of %d chunks, [DONE] %v", o.chunks, tokens, o.done)
		}
		outcomes = append(outcomes, o)
		if o.err != "" {
			continue
		}
		total = append(total, o.total)
		if stream {
			ttft = append(ttft, o.ttft)
			chunks += o.chunks
		}
	}
	errs, samples := errorSamples(outcomes)
	report["stream"] = stream
	report["sent"] = n
	report["ok"] = len(total)
	report["errors"] = errs
	report["error_samples"] = samples
	report["latency_ms"] = summary(total)
	if stream {
		report["ttft_ms"] = summary(ttft)
		report["chunks"] = chunks
	}
	if raw {
		samplesOut := map[string]any{"latency_ms": rounded(total)}
		if stream {
			samplesOut["ttft_ms"] = rounded(ttft)
		}
		report["samples"] = samplesOut
	}
}

func rateMode(g *generator, report map[string]any, rate, duration float64, tokens int, raw bool) {
	body := g.body(false, tokens)
	n := int(math.Round(rate * duration))
	interval := float64(time.Second) / rate
	outcomes := make([]outcome, n)
	var wg sync.WaitGroup
	start := time.Now()
	lateMax := time.Duration(0)
	for i := 0; i < n; i++ {
		at := start.Add(time.Duration(float64(i) * interval))
		if wait := time.Until(at); wait > 0 {
			time.Sleep(wait)
		} else if -wait > lateMax {
			lateMax = -wait
		}
		wg.Add(1)
		go func(i int, at time.Time) { // latency from the intended start: an open loop
			defer wg.Done()
			outcomes[i] = g.do(body, false, at, false)
		}(i, at)
	}
	sending := time.Since(start)
	wg.Wait()
	wall := time.Since(start)
	var latencies []float64
	for _, o := range outcomes {
		if o.err == "" {
			latencies = append(latencies, o.total)
		}
	}
	errs, samples := errorSamples(outcomes)
	report["rate"] = rate
	report["duration_s"] = duration
	report["sent"] = n
	report["ok"] = len(latencies)
	report["errors"] = errs
	report["error_samples"] = samples
	report["latency_ms"] = summary(latencies)
	report["offered_rps"] = round3(float64(n) / sending.Seconds())
	report["achieved_rps"] = round3(float64(len(latencies)) / wall.Seconds())
	report["wall_s"] = round3(wall.Seconds())
	report["sender_late_max_ms"] = round3(float64(lateMax) / float64(time.Millisecond))
	if raw {
		report["samples"] = map[string]any{"latency_ms": rounded(latencies)}
	}
}

func streamsMode(g *generator, report map[string]any, streams, tokens int, raw bool) {
	body := g.body(true, tokens)
	outcomes := make([]outcome, streams)
	var wg sync.WaitGroup
	ready := make(chan struct{})
	for k := 0; k < streams; k++ {
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			<-ready
			outcomes[k] = g.do(body, true, time.Now(), true)
		}(k)
	}
	start := time.Now()
	close(ready)
	wg.Wait()
	wall := time.Since(start)

	var ttft, gaps []float64
	chunks, complete, worstP99 := 0, 0, math.NaN()
	for k := range outcomes {
		o := &outcomes[k]
		chunks += o.chunks
		if o.err == "" && o.done && o.chunks == tokens {
			complete++
		} else if o.err == "" {
			o.err = fmt.Sprintf("incomplete stream: %d of %d chunks, [DONE] %v", o.chunks, tokens, o.done)
		}
		if o.ttft >= 0 {
			ttft = append(ttft, o.ttft)
		}
		gaps = append(gaps, o.gaps...)
		if len(o.gaps) > 0 {
			own := append([]float64(nil), o.gaps...)
			sort.Float64s(own)
			if p := percentile(own, 99); math.IsNaN(worstP99) || p > worstP99 {
				worstP99 = p
			}
		}
	}
	errs, samples := errorSamples(outcomes)
	gapSummary := summary(gaps)
	gapSummary["worst_stream_p99"] = round3(worstP99)
	report["streams"] = streams
	report["tokens"] = tokens
	report["wall_s"] = round3(wall.Seconds())
	report["chunks"] = chunks
	report["chunks_per_s"] = round3(float64(chunks) / wall.Seconds())
	report["complete"] = complete
	report["all_complete"] = complete == streams
	report["errors"] = errs
	report["error_samples"] = samples
	report["ttft_ms"] = summary(ttft)
	report["gap_ms"] = gapSummary
	if raw {
		report["samples"] = map[string]any{"ttft_ms": rounded(ttft), "gap_ms": rounded(gaps)}
	}
}
