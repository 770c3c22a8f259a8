// A small MCP-like JSON-RPC server on Go's standard library, for atmost's parser-differential
// tests. It decodes each body with encoding/json into structs, as Go MCP servers do, so object
// keys match field names case-insensitively (Unicode simple case folding) and the last match
// wins. It records every message it would execute and answers with a valid JSON-RPC response.
//
//	go_upstream -port 8200
//	    POST /mcp           one message or a batch; each is recorded
//	    GET  /_example/log  the recorded messages, the number of POSTs and their body bytes, as JSON
//	    POST /_example/reset forgets them
//
//	go_upstream -fold-check < table
//	    reads "rune canonical" pairs (hex, one pair a line: the filter's case-folding table)
//	    and prints, as JSON, every rune where the table and Go's unicode.SimpleFold disagree.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"unicode"
)

type params struct {
	Name      string          `json:"name"`
	Arguments json.RawMessage `json:"arguments"`
	Meta      map[string]any  `json:"_meta"`
}

type message struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Method  string          `json:"method"`
	Params  params          `json:"params"`
}

// payArgs is how a Go tool handler would read pay_invoice's arguments.
type payArgs struct {
	Invoice string `json:"invoice"`
	Amount  int64  `json:"amount"`
}

// entry is one executed message, as the tests read it.
type entry struct {
	Method    string         `json:"method"`
	Tool      string         `json:"tool,omitempty"`
	Arguments any            `json:"arguments,omitempty"`
	Amount    *int64         `json:"amount,omitempty"`
	Meta      map[string]any `json:"meta,omitempty"`
}

var (
	mu      sync.Mutex
	entries = []entry{}
	// Every POST to /mcp, decodable or not: a test can tell that nothing reached this server.
	requests = 0
	// Body bytes of those POSTs as read (a body cut short counts what came).
	bodyBytes = 0
)

func record(m message) {
	e := entry{Method: m.Method}
	if m.Method == "tools/call" {
		e.Tool = m.Params.Name
		e.Meta = m.Params.Meta
		if len(m.Params.Arguments) > 0 {
			var raw any
			if json.Unmarshal(m.Params.Arguments, &raw) == nil {
				e.Arguments = raw
			}
			var pay payArgs
			if m.Params.Name == "pay_invoice" && json.Unmarshal(m.Params.Arguments, &pay) == nil {
				e.Amount = &pay.Amount
			}
		}
	}
	mu.Lock()
	entries = append(entries, e)
	mu.Unlock()
}

func answer(m message) map[string]any {
	var result any
	switch m.Method {
	case "initialize":
		result = map[string]any{
			"protocolVersion": "2025-06-18",
			"capabilities":    map[string]any{"tools": map[string]any{}},
			"serverInfo":      map[string]any{"name": "atmost-go-upstream", "version": "1.0.0"},
		}
	case "tools/list":
		result = map[string]any{"tools": []any{
			map[string]any{"name": "pay_invoice", "inputSchema": map[string]any{"type": "object"}},
			map[string]any{"name": "echo", "inputSchema": map[string]any{"type": "object"}},
		}}
	case "tools/call":
		text := fmt.Sprintf("executed %s", m.Params.Name)
		result = map[string]any{"content": []any{map[string]any{"type": "text", "text": text}}}
	default:
		result = map[string]any{}
	}
	return map[string]any{"jsonrpc": "2.0", "id": m.ID, "result": result}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("content-type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func serveMCP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.WriteHeader(http.StatusMethodNotAllowed)
		return
	}
	mu.Lock()
	requests++
	mu.Unlock()
	body, err := io.ReadAll(r.Body)
	mu.Lock()
	bodyBytes += len(body)
	mu.Unlock()
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	var batch []message
	if trimmed := bytes.TrimSpace(body); len(trimmed) > 0 && trimmed[0] == '[' {
		err = json.Unmarshal(body, &batch)
	} else {
		var one message
		err = json.Unmarshal(body, &one)
		batch = []message{one}
	}
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]any{
			"jsonrpc": "2.0", "id": nil, "error": map[string]any{"code": -32700, "message": "Parse error"},
		})
		return
	}
	var out []any
	for _, m := range batch {
		record(m)
		if len(m.ID) > 0 && string(m.ID) != "null" {
			out = append(out, answer(m))
		}
	}
	switch {
	case len(out) == 0:
		w.WriteHeader(http.StatusAccepted)
	case len(body) > 0 && bytes.TrimSpace(body)[0] == '[':
		writeJSON(w, http.StatusOK, out)
	default:
		writeJSON(w, http.StatusOK, out[0])
	}
}

// foldRune is encoding/json's canonical form of a rune: the smallest one of its
// unicode.SimpleFold orbit.
func foldRune(r rune) rune {
	for {
		r2 := unicode.SimpleFold(r)
		if r2 <= r {
			return r2
		}
		r = r2
	}
}

func assigned(r rune) bool {
	for _, table := range unicode.Categories {
		if unicode.Is(table, r) {
			return true
		}
	}
	return false
}

type mismatch struct {
	Rune      string `json:"rune"`
	Table     string `json:"table"`
	Go        string `json:"go"`
	Explained bool   `json:"newer_unicode"`
}

// foldCheck compares the filter's table (non-ASCII runes only; ASCII letters fold among
// themselves) with Go. A difference is "newer_unicode" when the rune or its canonical form
// is not assigned in Go's Unicode version: the table may know characters Go does not yet.
func foldCheck() error {
	table := map[rune]rune{}
	scanner := bufio.NewScanner(os.Stdin)
	for scanner.Scan() {
		fields := strings.Fields(scanner.Text())
		if len(fields) != 2 {
			continue
		}
		from, err1 := strconv.ParseInt(fields[0], 16, 32)
		to, err2 := strconv.ParseInt(fields[1], 16, 32)
		if err1 != nil || err2 != nil {
			return fmt.Errorf("bad line %q", scanner.Text())
		}
		table[rune(from)] = rune(to)
	}
	if err := scanner.Err(); err != nil {
		return err
	}
	out := []mismatch{}
	for r := rune(0x80); r <= unicode.MaxRune; r++ {
		ours, ok := table[r]
		if !ok {
			ours = r
		}
		theirs := foldRune(r)
		if ours != theirs {
			out = append(out, mismatch{
				Rune:      fmt.Sprintf("%04X", r),
				Table:     fmt.Sprintf("%04X", ours),
				Go:        fmt.Sprintf("%04X", theirs),
				Explained: !assigned(r) || !assigned(ours),
			})
		}
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{
		"unicode_version": unicode.Version, "table_size": len(table), "mismatches": out,
	})
}

func main() {
	port := flag.Int("port", 8200, "port to listen on (127.0.0.1)")
	check := flag.Bool("fold-check", false, "compare a case-folding table on stdin with Go's")
	flag.Parse()
	if *check {
		if err := foldCheck(); err != nil {
			log.Fatal(err)
		}
		return
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/mcp", serveMCP)
	mux.HandleFunc("/_example/log", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"entries": entries, "requests": requests, "body_bytes": bodyBytes})
	})
	mux.HandleFunc("/_example/reset", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		entries = []entry{}
		requests = 0
		bodyBytes = 0
		mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"ok": true})
	})
	addr := fmt.Sprintf("127.0.0.1:%d", *port)
	log.Printf("listening on %d", *port)
	log.Fatal(http.ListenAndServe(addr, mux))
}
