(function(){
  var spans = JSON.parse(document.getElementById('step-spans').textContent);
  function zoom(lo, hi){
    var div = document.getElementById('timeline');
    var ks = Object.keys(spans).map(Number).filter(function(k){return k >= lo && k <= hi;});
    if(!div || !ks.length){return;}
    var a = Math.min.apply(null, ks.map(function(k){return spans[k][0];}));
    var b = Math.max.apply(null, ks.map(function(k){return spans[k][1];}));
    var pad = (b - a) * 0.02;
    Plotly.relayout(div, {'xaxis.range': [a - pad, b + pad]});
  }
  var form = document.getElementById('stepform');
  if(form){form.addEventListener('submit', function(ev){
    ev.preventDefault();
    zoom(Number(document.getElementById('step_lo').value), Number(document.getElementById('step_hi').value));
  });}
  var all = document.getElementById('step_all');
  if(all){all.addEventListener('click', function(){
    Plotly.relayout(document.getElementById('timeline'), {'xaxis.autorange': true});
  });}
  document.querySelectorAll('button[data-step]').forEach(function(b){
    b.addEventListener('click', function(){var k = Number(b.dataset.step); zoom(k, k);});
  });
})();
