// go-same: the go-floor anchor's webhook answering what copilot-webhook's /mutate/ptrace answers for a
// Flyte 1.15 copilot pod: SYS_PTRACE on each primary container without a securityContext, the
// copilot-webhook.io/mutated annotation and the ptrace audit annotation (that audit annotation alone for a
// pod without the copilot uploader). A control for bench/pods_bench.py: the same answer from the Go standard
// library, so what the API server spends on the answer is measured apart from what the server spends
// producing it. It answers only the pods the bench sends; tests/test_go_same.py holds those answers equal.
package main

import (
	"encoding/json"
	"flag"
	"io"
	"log"
	"net/http"
	"os"
	"strconv"
	"strings"
)

const (
	annotation = "copilot-webhook.io/mutated"
	summary    = "ptrace=add:primary"
)

type review struct {
	APIVersion string                 `json:"apiVersion"`
	Kind       string                 `json:"kind"`
	Request    map[string]interface{} `json:"request,omitempty"`
	Response   map[string]interface{} `json:"response,omitempty"`
}

func answer(rv review) review {
	uid, _ := rv.Request["uid"].(string)
	ops := []map[string]interface{}{}
	obj, _ := rv.Request["object"].(map[string]interface{})
	meta, _ := obj["metadata"].(map[string]interface{})
	spec, _ := obj["spec"].(map[string]interface{})
	cs, _ := spec["containers"].([]interface{})
	copilot := false
	for _, c := range cs {
		cm, _ := c.(map[string]interface{})
		if cm["name"] == "flyte-copilot-uploader" {
			copilot = true
		}
	}
	for i, c := range cs {
		cm, _ := c.(map[string]interface{})
		name, _ := cm["name"].(string)
		if copilot && !strings.HasPrefix(name, "flyte-copilot-") {
			if _, ok := cm["securityContext"]; !ok {
				ops = append(ops, map[string]interface{}{"op": "add", "path": "/spec/containers/" + strconv.Itoa(i) + "/securityContext",
					"value": map[string]interface{}{"capabilities": map[string]interface{}{"add": []string{"SYS_PTRACE"}}}})
			}
		}
	}
	resp := map[string]interface{}{"uid": uid, "allowed": true}
	if len(ops) > 0 {
		if _, ok := meta["annotations"].(map[string]interface{}); ok {
			ops = append(ops, map[string]interface{}{"op": "add", "path": "/metadata/annotations/" + strings.ReplaceAll(annotation, "/", "~1"), "value": summary})
		} else {
			ops = append(ops, map[string]interface{}{"op": "add", "path": "/metadata/annotations", "value": map[string]string{annotation: summary}})
		}
		p, _ := json.Marshal(ops)
		resp["patchType"] = "JSONPatch"
		resp["patch"] = p // []byte marshals as base64
		resp["auditAnnotations"] = map[string]string{"ptrace": "add:primary"}
	} else if !copilot {
		resp["auditAnnotations"] = map[string]string{"ptrace": "add:none(no-watcher)"}
	}
	return review{APIVersion: rv.APIVersion, Kind: "AdmissionReview", Response: resp}
}

func mutate(w http.ResponseWriter, r *http.Request) {
	var rv review
	if err := json.NewDecoder(r.Body).Decode(&rv); err != nil || rv.Request == nil {
		http.Error(w, "bad review", 400)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(answer(rv))
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9443", "listen address")
	cert := flag.String("cert", "", "TLS certificate")
	key := flag.String("key", "", "TLS key")
	once := flag.Bool("answer", false, "answer the AdmissionReview on standard input and exit")
	flag.Parse()
	if *once {
		var rv review
		body, err := io.ReadAll(os.Stdin)
		if err == nil {
			err = json.Unmarshal(body, &rv)
		}
		if err != nil || rv.Request == nil {
			log.Fatal("bad review")
		}
		json.NewEncoder(os.Stdout).Encode(answer(rv))
		return
	}
	http.HandleFunc("/mutate", mutate)
	log.Fatal(http.ListenAndServeTLS(*addr, *cert, *key, nil))
}
